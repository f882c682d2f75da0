"""The codec registry: every chunk codec, host and GPU, by its on-disk id, and the per-chunk choice.

One table, CODECS, maps a codec id (FORMAT.md, "Codec ids"; part of the on-disk format, never reused)
to a CodecEntry: its name, where it runs (`host`: the CPU, in this process; `gpu`: nvCOMP on a
device), for host codecs the encode and decode functions, and for a codec the per-chunk choice may
pick, its Choosable object (probe a sample, encode into a buffer). Every id the format has ever
assigned is known (FORMAT_IDS) so that a header naming a GPU codec parses on a machine without one;
a GPU codec's entry is registered only when nvCOMP is importable here (its device-side codec objects
are made per stream by storage/gpu/device.py, which looks the nvCOMP algorithm up in this table).

Adding a codec is one `register` call: its id and name join CODEC_IDS / CODEC_NAMES (what headers
and manifests may name), the chooser probes it if it is Choosable, and a store lists it in its
marker's `requires` once it holds an entry of it (FORMAT.md, "The marker's `requires`"): no store
version changes, and a gpusnap without the codec refuses only the stores that use it. Nothing
outside this module keeps a list of codec names (storage/pipeline/encodeprocs.py and
storage/maintenance/repair.py ask host_codecs()).
Every threshold of the choice lives in the "Thresholds" block below, and only there.

Guarantees kept here: a decoder never produces, nor allocates for its output, more than the raw
length it is given (the caller's bound: a chunk's declared raw length, itself bounded by
chunkfile.MAX_RAW_CHUNK), allocates working memory only after the payload's own header agrees with
that length, and returns exactly that many bytes or raises CodecError; a chunk is
stored with a codec only when it saves more than PAYS_OFF_RATIO allows, else raw. Decoding is not
verification: the caller binds the decoded bytes to the chunk id (chunkfile.full_check).

Why `shuffle2-zstd` (id 2) is our own and not python-blosc2's SHUFFLE+ZSTD (both measured on the dev
VM on the same data, BENCHMARKS.md section 9): ours has the better ratio (bf16 weights 1.49x against
blosc2's 1.45x and zstd-1's 1.28x; a KV pool 30% filled 4.93x against 4.78x and 4.25x), encodes
faster on both and decodes faster on weights (blosc2 decodes the KV-like data faster). And `import
blosc2` takes ~1.4 s and pulls in httpx, pydantic, numexpr and rich (every CLI call that restores
would pay it, and the GPU machine would have to carry them), and its C chunk parser would read
hostile payloads before any hash check. Ours is numpy's vectorized shift/mask (~7 GB/s per core to
split, ~5 to merge) and zstd, which the store already trusts, behind a 16-byte header. Its second
half is what blosc2 does not do: the planes are encoded apart, each with zstd or stored as it is,
chosen on a sample, so the mantissa plane of weights (noise) costs no compression pass at all; and
the exponent plane is compressed with parameters that favour zstd's entropy coder over short
matches (PLANE_ZSTD: 2.94x on that plane against level 1's 2.71x, ~2.7x faster there).

nvCOMP for host-staged bytes (issue 21; scripts/bench/bench_codecs.py measures it): the host path
stores only host codecs (any machine can decode a snapshot), and nvCOMP's Zstd with the RAW
bitstream takes plain zstd frames, so a free GPU could decode them with no change of format. It is
measured and not used: on the H200 (2026-12-01, BENCHMARKS.md section 15) nvCOMP's Zstd decoded the
host path's own frames, in batches of 64 MiB from pinned memory and back on one stream, at 2.2 GB/s
(bf16 weights) and 5.0 GB/s (a KV pool 30% filled), against 14.1 and 10.2 GB/s for this module's
decoders on the machine's 16 cores; nvCOMP's own formats decode at 20-36 GB/s there, but a snapshot stored
with them could be restored only where nvCOMP and a GPU are. A restore is bound by the disk (~2
GB/s) long before the CPU decoders, so the GPU would buy nothing there either.
"""
from __future__ import annotations

import importlib.util
import struct
import threading
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Callable, Collection, Mapping, Protocol

from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported on first use: a listing or --help needs neither
    import numpy as np
    import zstandard

from storage.codecs import shufflelib

from storage.codecs import zstdlib
from storage.fs.directio import copy_into
from storage.base.errors import GpusnapError

# --------------------------------------------------------------------------------------- thresholds
# Every number the codec choice depends on (host and GPU), here and nowhere else.
PAYS_OFF_RATIO = 0.97        # stored/raw above this: store raw (decoding would buy almost nothing)
MIN_COMPRESS = 512           # chunks smaller than this are stored raw
SAMPLE_PIECES = 4            # the choice compresses SAMPLE_PIECES pieces spread over the chunk ...
SAMPLE_PIECE = 16 * 1024     # ... of this many bytes each (64 KiB of a 4 MiB chunk: ~1.6% of its bytes)
SHUFFLE_MIN_GAIN = 0.95      # a byte-plane codec is chosen only if its sample is <= this fraction of zstd's
SHUFFLE4_PROBE_ABOVE = 0.8   # shuffle4-zstd is probed only where the best so far keeps more than this
                             # fraction of the sample: fp32 weights keep ~0.89 with shuffle2, bf16 ~0.66
                             # and a KV pool ~0.2, where four planes never gain enough to pay their probe
                             # (+4-7% of the encode's time on bf16 data, dev VM)
PLANE_PAYS_OFF = PAYS_OFF_RATIO  # a byte plane is stored as it is when zstd does not beat this
ZSTD_LEVEL = 1               # the host path's zstd level (put, CRIU images, repair)
GPU_PAYS_OFF_RATIO = PAYS_OFF_RATIO  # storage/pipeline/gpu_engine.py: a GPU chunk above this is stored raw
DELTA_PAYS_OFF = 0.5         # a delta entry (xor-zstd) is stored only if its payload is at most this
                             # fraction of the chunk's plain encoding (else the plain entry is stored)
DELTA_MATCH = 0.9            # a delta reference holding this fraction of a chunk's bytes is taken at once
                             # (the first of a dump's candidate places that does: storage/pipeline/put.py);
                             # below it the candidates are mixed page by page where that holds more


def nvcomp_out_bound(n: int) -> int:
    """Bytes an nvCOMP encode of N bytes may need for its output, for every registered nvCOMP codec:
    GDeflate's bound is just over 2x its input (134,529,088 bytes for 64 MiB, seen on the H200); ANS,
    Bitcomp and LZ4 stay under 1.5x. nvCOMP refuses an external output buffer below the bound."""
    return 2 * n + (4 << 20)
# zstd parameters for one byte plane: a tiny hash table and long minimum matches leave most bytes to
# zstd's Huffman literals, which is what an exponent plane (few distinct bytes, no long repeats) needs;
# runs of zeros are still found as repeats. Measured against level 1 on bf16 exponents: 2.94x vs 2.71x,
# 730 vs 270 MB/s encode, 1.4 vs 0.8 GB/s decode (dev VM, one core).
PLANE_ZSTD = dict(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
                  strategy="fast")  # zstandard.STRATEGY_FAST, resolved where the compressor is made

# Every codec id the on-disk format has assigned (FORMAT.md, "Codec ids"). Never reuse an id.
FORMAT_IDS: Mapping[str, int] = MappingProxyType({
    "raw": 0, "zstd": 1, "shuffle2-zstd": 2, "xor-zstd": 3, "shuffle4-zstd": 4,
    "nvcomp-ans": 16, "nvcomp-bitcomp": 17, "nvcomp-lz4": 18, "nvcomp-gdeflate": 19})
# Every codec id this gpusnap knows: the format's, and any registered since (register adds to both).
# Headers (chunkfile) and manifests may name exactly these; a store's `requires` may list exactly these.
CODEC_IDS: dict[str, int] = dict(FORMAT_IDS)
CODEC_NAMES: dict[int, str] = {v: k for k, v in FORMAT_IDS.items()}
ZERO = "zero"  # not a codec id: a chunk reference with no file
DELTA = "xor-zstd"  # a delta entry against a base chunk (FORMAT.md, "Delta entries"): decoded by
                    # storage/codecs/delta.py with the base's raw bytes, never by decode_host (not in CODECS)
NVCOMP_ALGORITHMS: dict[str, str] = {"nvcomp-ans": "ANS", "nvcomp-bitcomp": "Bitcomp", "nvcomp-lz4": "LZ4",
                                     "nvcomp-gdeflate": "GDeflate"}


def _zstd() -> ModuleType:
    """The zstandard module, imported on first use (a listing or --help never needs it)."""
    import zstandard
    return zstandard


def _np() -> ModuleType:
    """numpy, imported on first use (the byte-plane codec's split and merge)."""
    import numpy
    return numpy


class CodecError(GpusnapError):
    """A payload that does not decode, or a codec this build does not know."""


class Codec(Protocol):
    name: str

    def encode(self, data: memoryview) -> bytes | memoryview: ...

    def decode(self, payload: memoryview, raw_len: int) -> bytes | memoryview: ...


Decoder = Callable[[memoryview, int, "memoryview | None"], "bytes | memoryview"]


class Choosable(Protocol):
    """A host codec the per-chunk choice (HostCodecChooser) may pick besides zstd and raw.

    WIDTH: the chunk's length must be a multiple of it (the element size). PROBE_ABOVE: it is probed
    only where the best encoding so far keeps more than this fraction of the sample (None: always).
    probe(sample) -> (which of its parts pay zstd: a tuple with at least one True if it is worth
    anything, the sample's payload size so). encode_into(data, dst, parts) -> the payload's length in
    DST, or None when it does not fit (DATA and DST never overlap)."""

    name: str
    width: int
    probe_above: float | None

    def probe(self, data: memoryview) -> tuple[tuple[bool, ...], int]: ...

    def encode_into(self, data: memoryview, dst: memoryview, which: tuple[bool, ...]) -> int | None: ...


@dataclass(frozen=True)
class CodecEntry:
    """One registered codec. Host codecs: encode(data) -> payload; decode(payload, raw_len, out) ->
    exactly raw_len bytes (into OUT when given: at least raw_len writable bytes). GPU codecs: no
    host functions; `algorithm` is nvCOMP's name, device.CudaDevice makes one codec per stream."""

    id: int
    name: str
    where: str                                   # "host" or "gpu"
    encode: Callable[[memoryview], "bytes | memoryview"] | None = None
    decode: Decoder | None = None
    algorithm: str | None = None                 # nvCOMP's algorithm name (GPU codecs)
    choosable: Choosable | None = None           # host codecs the per-chunk choice may pick (besides zstd)


# ------------------------------------------------------------------------------------ host codecs
class RawCodec:
    name = "raw"

    def encode(self, data: memoryview) -> memoryview:
        return data

    def decode(self, payload: memoryview, raw_len: int) -> memoryview:
        if len(payload) != raw_len:
            raise CodecError(f"raw payload is {len(payload)} bytes, expected {raw_len}")
        return payload


class ZstdCodec:
    """zstd, one frame per chunk. Through libzstd (storage/codecs/zstdlib.py: into the caller's buffers, the GIL
    released) where it is loaded, else python-zstandard (whose objects are per thread: not thread-safe)."""

    name = "zstd"

    def __init__(self, level: int = ZSTD_LEVEL, params: dict | None = None) -> None:
        self.level = level
        self.params = params
        self._local = threading.local()
        self._native = zstdlib.Compressor(level, params) if zstdlib.available() else None

    def _cctx(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            if self.params is not None:
                z = _zstd()
                params = dict(self.params)
                params["strategy"] = getattr(z, "STRATEGY_" + str(params["strategy"]).upper())
                cp = z.ZstdCompressionParameters(write_content_size=True, **params)
                c = _zstd().ZstdCompressor(compression_params=cp)
            else:
                c = _zstd().ZstdCompressor(level=self.level, write_content_size=True)
            self._local.c = c
        return c

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = _zstd().ZstdDecompressor()
        return d

    def encode(self, data: memoryview) -> bytes:
        return self._cctx().compress(data)

    def encode_into(self, data: memoryview, dst: memoryview) -> int | None:
        """DATA as one zstd frame in DST; its length, or None when it does not fit in len(DST) bytes
        (the caller sizes DST to what would pay off)."""
        if self._native is not None:
            try:
                return self._native.compress_into(data, dst)
            except zstdlib.ZstdLibError as e:
                raise CodecError(str(e)) from None
        z = self._cctx().compress(data)
        if len(z) > len(dst):
            return None
        copy_into(dst, z)
        return len(z)

    def decode(self, payload: memoryview, raw_len: int) -> bytes | memoryview:
        if zstdlib.available():
            return self.decode_into(payload, raw_len, memoryview(bytearray(raw_len)))
        return self._decode_py(payload, raw_len)

    def _decode_py(self, payload: memoryview, raw_len: int) -> bytes:
        """Without libzstd: python-zstandard, given only the frames the libzstd path takes (one frame
        declaring RAW_LEN bytes, spanning PAYLOAD: zstdlib.check_frame_py), its output exactly RAW_LEN bytes."""
        try:
            zstdlib.check_frame_py(payload, raw_len)
            out = self._dctx().decompress(payload, max_output_size=raw_len)
        except zstdlib.ZstdLibError as e:
            raise CodecError(str(e)) from None
        except (_zstd().ZstdError, MemoryError) as e:
            raise CodecError(f"zstd payload does not decode: {e}") from None
        if len(out) != raw_len:
            raise CodecError(f"zstd payload decoded to {len(out)} bytes, expected {raw_len}")
        return out

    def decode_into(self, payload: memoryview, raw_len: int, dst: memoryview) -> memoryview:
        """PAYLOAD decoded into DST[:RAW_LEN] with no allocation; never writes past it."""
        dst = dst[:raw_len]
        if len(dst) != raw_len:
            raise CodecError(f"decode buffer of {len(dst)} bytes for {raw_len}")
        if zstdlib.available():
            try:
                zstdlib.decompress_into(payload, dst)
            except zstdlib.ZstdLibError as e:
                raise CodecError(str(e)) from None
            return dst
        copy_into(dst, memoryview(self._decode_py(payload, raw_len)))
        return dst


class _PlaneScratch:
    """What the byte-plane codecs share: a zstd codec for their planes, and working memory: one buffer
    per thread, reused from chunk to chunk up to KEEP bytes (chunks are 2-4 MiB; a payload claiming a
    chunk of up to 1 GiB, refused or not, leaves no such buffer behind in every thread that decoded
    one)."""

    KEEP = 32 << 20

    def __init__(self) -> None:
        self._local = threading.local()
        self.zstd = ZstdCodec(params=PLANE_ZSTD)

    def _put_plane(self, split: Callable[[np.ndarray], None], try_zstd: bool, dst: memoryview,
                   out: np.ndarray, pos: int, size: int, scratch: np.ndarray) -> tuple[int, int] | None:
        """One plane of SIZE bytes into DST at POS (OUT: DST as bytes), SPLIT(into) writing it: a
        plane not to be tried (not TRY_ZSTD) split straight into DST; else split into SCRATCH and
        one zstd frame written if it shrinks the plane below PLANE_PAYS_OFF, the plane copied as it
        is if not. (the position after it, its kind: 0 as it is, 1 a frame); None when it does not
        fit in DST."""
        room = len(dst) - pos
        if not try_zstd:
            if room < size:
                return None
            split(out[pos:pos + size])
            return pos + size, 0
        split(scratch)
        z = self.zstd.encode_into(scratch.data, dst[pos:pos + min(room, int(PLANE_PAYS_OFF * size))])
        if z is not None:
            return pos + z, 1
        if room < size:
            return None
        copy_into(dst[pos:pos + size], scratch.data)
        return pos + size, 0

    def _scratch_view(self, n: int) -> memoryview:
        """This thread's plane buffer of at least N bytes (grown to the largest chunk up to KEEP it has
        seen; a larger one is this call's own), its first N bytes."""
        if n > self.KEEP:
            return memoryview(bytearray(n))
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._local.buf = memoryview(bytearray(n))
        return buf[:n]


def _check_plane(codec: str, kind: int, stored: memoryview, h: int) -> None:
    """What can be checked of one byte plane of a CODEC payload before anything is allocated for it: a
    stored plane's length; a zstd plane's frame header, which must declare exactly H bytes (and with
    libzstd, the frame must span the plane: one frame, nothing after it)."""
    if kind == 0:
        if len(stored) != h:
            raise CodecError(f"{codec} plane of {len(stored)} bytes, expected {h}")
    elif kind == 1:
        if zstdlib.available():
            try:
                zstdlib.check_frame(stored, h)
            except zstdlib.ZstdLibError as e:
                raise CodecError(f"{codec} plane: {e}") from None
            return
        try:
            declared = _zstd().frame_content_size(stored)
        except _zstd().ZstdError as e:
            raise CodecError(f"{codec} plane is not a zstd frame: {e}") from None
        if declared != h:
            raise CodecError(f"{codec} plane declares {declared} bytes, expected {h}")
    else:
        raise CodecError(f"{codec} plane kind {kind} unknown")


class Shuffle2Codec(_PlaneScratch):
    """`shuffle2-zstd`: 2-byte elements (bf16, fp16, int16) split into their low and high byte planes,
    each plane zstd-compressed or kept as it is. Payload (FORMAT.md, "Codec ids"):

        0       u8   layout: 1 the elements as they are; 2 each element rotated left by one bit first
        1       u8   plane 0 (the low bytes) stored as: 0 itself, 1 one zstd frame
        2       u8   plane 1 (the high bytes) likewise
        3..7         zero
        8..15   u64 LE  plane 0's stored length
        16..         plane 0, then plane 1 (the rest of the payload)

    The raw length is even; each plane decodes to exactly half of it. This writer writes layout 2: a
    bf16's high plane is then its whole exponent and its low plane its mantissa and sign, so the
    exponent's last bit, which is not noise, is coded with the rest of the exponent instead of being
    stored among the mantissa's noise (~1% fewer bytes on bf16 weights and KV blocks; fp16 unchanged).
    Layout 1 is still read.
    """

    name = "shuffle2-zstd"
    width = 2
    probe_above: float | None = None
    _HEAD = struct.Struct("<BBB5xQ")
    LAYOUT = 2  # what this writer writes
    _BLOCK = 1 << 18  # elements per step of a layout 2 split or merge (its temporaries stay in cache)



    def _scratch(self, n: int) -> np.ndarray:
        """_scratch_view as a numpy array (the split, and the merge without the C library)."""
        return _np().frombuffer(self._scratch_view(n), _np().uint8)

    def _step(self) -> np.ndarray:
        """This thread's temporary for one step of a layout 2 split or merge (_BLOCK 2-byte elements)."""
        t = getattr(self._local, "step", None)
        if t is None:
            t = self._local.step = _np().empty(self._BLOCK, "<u2")
        return t

    def split(self, data: memoryview, planes: np.ndarray, layout: int | None = None) -> None:
        """The low bytes of DATA's 2-byte elements (in LAYOUT) into PLANES[:h], the high bytes into
        PLANES[h:]."""
        a = _np().frombuffer(data, "<u2")
        h = a.size
        layout = self.LAYOUT if layout is None else layout
        self._plane_of(a, 0, planes[:h], layout)
        self._plane_of(a, 1, planes[h:], layout)

    def probe(self, data: memoryview) -> tuple[tuple[bool, bool], int]:
        """On DATA (a sample, even length): whether each plane pays zstd, and the payload size that
        choice gives."""
        n = len(data)
        h = n // 2
        planes = self._scratch(n + h)  # the planes, then room for one plane's frame
        self.split(data, planes[:n])
        room = planes[n:n + int(PLANE_PAYS_OFF * h)].data
        size, pays = self._HEAD.size, []
        for i in (0, 1):
            z = self.zstd.encode_into(planes[i * h:(i + 1) * h].data, room)
            pays.append(z is not None)
            size += z if z is not None else h
        return (pays[0], pays[1]), size

    def encode(self, data: memoryview, which: tuple[bool, ...] = (True, True)) -> bytes:
        """DATA (even length) as planes; WHICH says which planes to try zstd on (a plane that does not
        shrink below PLANE_PAYS_OFF is stored as it is)."""
        out = memoryview(bytearray(self._HEAD.size + len(data)))
        m = self.encode_into(data, out, which)
        assert m is not None  # both planes stored as they are always fit
        return bytes(out[:m])

    def encode_into(self, data: memoryview, dst: memoryview, which: tuple[bool, ...] = (True, True)) -> int | None:
        """DATA (even length) as planes into DST: the payload's length, or None when it does not fit in
        len(DST) bytes. WHICH: the planes to try zstd on; a plane whose frame would not shrink it below
        PLANE_PAYS_OFF is stored as it is. Nothing is allocated (this thread's plane buffer is reused);
        a plane not tried is split straight into DST (no copy: the low bytes of bf16 weights, the
        usual case, are stored as they are), so DATA and DST must not overlap."""
        n = len(data)
        if n % 2:
            raise CodecError("shuffle2-zstd needs an even number of bytes")
        h = n // 2
        head = self._HEAD.size
        if len(dst) < head:
            return None
        np = _np()
        a = np.frombuffer(data, "<u2")
        out = np.frombuffer(dst, np.uint8)
        planes = self._scratch(h)
        pos, kinds, n0 = head, [0, 0], 0
        for i in (0, 1):
            got = self._put_plane(partial(self._plane_of, a, i, layout=self.LAYOUT), which[i], dst, out, pos, h,
                                  planes)
            if got is None:
                return None
            pos, kinds[i] = got
            if i == 0:
                n0 = pos - head
        dst[:head] = self._HEAD.pack(self.LAYOUT, kinds[0], kinds[1], n0)
        return pos

    def _plane_of(self, a: np.ndarray, i: int, into: np.ndarray, layout: int) -> None:
        """Plane I of the 2-byte elements A (0: low bytes, 1: high bytes) in LAYOUT into INTO. Layout 2
        takes the bytes of each element rotated left by one bit: the high plane is bits 7..14 (a bf16's
        exponent), the low plane bits 0..6 shifted up by one with bit 15 (the sign) as its bit 0.
        In one C call where the library is built (storage/codecs/shufflelib.py), else with numpy."""
        if shufflelib.plane(a, i, into, layout):
            return
        np = _np()
        if i == 1:
            np.right_shift(a, 7 if layout == 2 else 8, out=into, casting="unsafe")  # the cast keeps 8 bits
        elif layout != 2:
            np.bitwise_and(a, 0xFF, out=into, casting="unsafe")
        else:
            sign = self._step().view(np.uint8)
            for s in range(0, a.size, self._BLOCK):
                e = min(a.size, s + self._BLOCK)
                seg, t = into[s:e], sign[:e - s]
                np.left_shift(a[s:e], 1, out=seg, casting="unsafe")
                np.right_shift(a[s:e], 15, out=t, casting="unsafe")
                np.bitwise_or(seg, t, out=seg)

    @classmethod
    def _check_plane(cls, kind: int, stored: memoryview, h: int) -> None:
        _check_plane(cls.name, kind, stored, h)

    def _plane(self, kind: int, stored: memoryview, h: int, scratch: memoryview) -> memoryview:
        """One plane's H bytes: a stored plane where it lies, a zstd one decoded into SCRATCH."""
        if kind == 0:
            return stored
        self.zstd.decode_into(stored, h, scratch)
        return scratch

    def decode(self, payload: memoryview, raw_len: int, out: memoryview | None = None) -> bytes | memoryview:
        """Exactly RAW_LEN bytes (into OUT when given, else a new buffer of RAW_LEN bytes). Working
        memory: half of RAW_LEN per zstd plane (this thread's, reused), allocated only once the
        header, the planes' lengths and the frames' declared sizes agree with RAW_LEN."""
        payload = memoryview(payload).cast("B")
        if raw_len % 2 or len(payload) < self._HEAD.size:
            raise CodecError(f"shuffle2-zstd payload of {len(payload)} bytes for {raw_len} raw bytes")
        layout, k0, k1, n0 = self._HEAD.unpack_from(payload)
        if layout not in (1, 2) or n0 > len(payload) - self._HEAD.size:
            raise CodecError(f"shuffle2-zstd header unknown (layout {layout}, plane 0 of {n0} bytes)")
        h = raw_len // 2
        body = payload[self._HEAD.size:]
        p0, p1 = body[:n0], body[n0:]
        self._check_plane(k0, p0, h)
        self._check_plane(k1, p1, h)
        if out is not None and len(out) < raw_len:
            raise CodecError(f"decode buffer of {len(out)} bytes for {raw_len}")
        planes = self._scratch_view(h * (k0 + k1))
        dst = memoryview(bytearray(raw_len)) if out is None else out[:raw_len]
        if zstdlib.available() and zstdlib.DECOMPRESS_DCTX:
            # both planes and the merge in one C call: one hand-over of the GIL instead of three
            with zstdlib.dctx() as d:
                rc = shufflelib.decode_planes(p0, k0, p1, k1, layout, planes, dst, d, zstdlib.DECOMPRESS_DCTX)
            if rc is not None:
                if rc:
                    raise CodecError(f"shuffle2-zstd plane {-rc - 1} does not decode to {h} bytes")
                return dst
        lo = self._plane(k0, p0, h, planes[:h])
        hi = self._plane(k1, p1, h, planes[k0 * h:k0 * h + h])
        if not shufflelib.merge_views(lo, hi, dst, layout):  # numpy only where the C merge cannot take these
            np = _np()
            self._merge(np.frombuffer(lo, np.uint8), np.frombuffer(hi, np.uint8), np.frombuffer(dst, "<u2"), layout)
        return dst

    def _merge(self, lo: np.ndarray, hi: np.ndarray, o: np.ndarray, layout: int) -> None:
        """The 2-byte elements O from their planes LO and HI in LAYOUT (2: each rotated right by one bit
        after the bytes are joined, a step of _BLOCK elements at a time). In one C call where the
        library is built (storage/codecs/shufflelib.py), else with numpy."""
        if shufflelib.merge(lo, hi, o, layout):
            return
        np = _np()
        if layout != 2:
            np.left_shift(hi, 8, out=o, dtype="<u2")
            np.bitwise_or(o, lo, out=o)
            return
        step = self._step()
        for s in range(0, o.size, self._BLOCK):
            e = min(o.size, s + self._BLOCK)
            seg, t = o[s:e], step[:e - s]
            np.left_shift(hi[s:e], 8, out=seg, dtype="<u2")
            np.bitwise_or(seg, lo[s:e], out=seg)
            np.left_shift(seg, 15, out=t)
            np.right_shift(seg, 1, out=seg)
            np.bitwise_or(seg, t, out=seg)


class Shuffle4Codec(_PlaneScratch):
    """`shuffle4-zstd` (store version 7): 4-byte elements (fp32, int32) split into their four byte
    planes, each plane zstd-compressed or kept as it is. Payload (FORMAT.md, "Codec ids"):

        0       u8   layout: 1 (the only one)
        1..4    u8   planes 0..3 stored as: 0 themselves, 1 one zstd frame
        5..7         zero
        8..31   u64 LE x 3  the stored lengths of planes 0, 1, 2
        32..         planes 0, 1, 2, then plane 3 (the rest of the payload)

    Plane k is byte k of each little-endian element: for fp32 weights plane 3 is the sign and seven
    bits of the exponent (few values: zstd's Huffman coder takes it to ~0.4 of its bytes), plane 2 the
    exponent's last bit over seven of the mantissa's, planes 0 and 1 mantissa noise, stored as they are.
    On fp32 weights ~0.84 of their bytes against zstd-1's ~0.93 (no rotation as shuffle2's layout 2
    has: measured, it saved 0.5% on such weights and cost 4% on fp32 values with bf16's precision).
    """

    name = "shuffle4-zstd"
    width = 4
    probe_above: float | None = SHUFFLE4_PROBE_ABOVE
    _HEAD = struct.Struct("<BBBBB3x3Q")
    LAYOUT = 1



    def _plane_of(self, a: np.ndarray, i: int, into: np.ndarray) -> None:
        """Plane I (byte I of each element) of the uint32 elements A into INTO: in one C call where the
        library is built (storage/codecs/shufflelib.py), else with numpy (the cast keeps the low 8 bits)."""
        if not shufflelib.plane4(a, i, into):
            _np().right_shift(a, 8 * i, out=into, casting="unsafe")

    def probe(self, data: memoryview) -> tuple[tuple[bool, ...], int]:
        """On DATA (a sample, length a multiple of 4): whether each plane pays zstd, and the payload size
        that choice gives."""
        np = _np()
        q = len(data) // 4
        a = np.frombuffer(data, "<u4")
        buf = np.frombuffer(self._scratch_view(q + int(PLANE_PAYS_OFF * q)), np.uint8)
        plane, room = buf[:q], buf[q:].data
        size, pays = self._HEAD.size, []
        for i in range(4):
            self._plane_of(a, i, plane)
            z = self.zstd.encode_into(plane.data, room)
            pays.append(z is not None)
            size += z if z is not None else q
        return tuple(pays), size

    def encode_into(self, data: memoryview, dst: memoryview, which: tuple[bool, ...] = (True,) * 4) -> int | None:
        """DATA (length a multiple of 4) as planes into DST: the payload's length, or None when it does
        not fit in len(DST) bytes. WHICH: the planes to try zstd on; a plane whose frame would not
        shrink it below PLANE_PAYS_OFF is stored as it is. A plane not tried is split straight into
        DST, so DATA and DST must not overlap. Nothing is allocated (this thread's buffer is reused)."""
        n = len(data)
        if n % 4:
            raise CodecError("shuffle4-zstd needs a multiple of 4 bytes")
        q = n // 4
        head = self._HEAD.size
        if len(dst) < head:
            return None
        np = _np()
        a = np.frombuffer(data, "<u4")
        out = np.frombuffer(dst, np.uint8)
        plane = np.frombuffer(self._scratch_view(q), np.uint8)
        pos, kinds, lengths = head, [0, 0, 0, 0], []
        for i in range(4):
            got = self._put_plane(partial(self._plane_of, a, i), which[i], dst, out, pos, q, plane)
            if got is None:
                return None
            lengths.append(got[0] - pos)
            pos, kinds[i] = got
        dst[:head] = self._HEAD.pack(self.LAYOUT, *kinds, *lengths[:3])
        return pos

    def encode(self, data: memoryview, which: tuple[bool, ...] = (True,) * 4) -> bytes:
        """encode_into a buffer of its own (tests)."""
        out = memoryview(bytearray(self._HEAD.size + len(data)))
        m = self.encode_into(data, out, which)
        assert m is not None  # four planes stored as they are always fit
        return bytes(out[:m])

    def decode(self, payload: memoryview, raw_len: int, out: memoryview | None = None) -> bytes | memoryview:
        """Exactly RAW_LEN bytes (into OUT when given, else a new buffer of RAW_LEN bytes). Working
        memory: a quarter of RAW_LEN per zstd plane (this thread's, reused), allocated only once the
        header, the planes' lengths and the frames' declared sizes agree with RAW_LEN."""
        payload = memoryview(payload).cast("B")
        head = self._HEAD.size
        if raw_len % 4 or len(payload) < head:
            raise CodecError(f"shuffle4-zstd payload of {len(payload)} bytes for {raw_len} raw bytes")
        layout, k0, k1, k2, k3, n0, n1, n2 = self._HEAD.unpack_from(payload)
        kinds = [k0, k1, k2, k3]
        if layout != self.LAYOUT or bytes(payload[5:8]) != bytes(3) or n0 + n1 + n2 > len(payload) - head:
            raise CodecError(f"shuffle4-zstd header unknown (layout {layout}, planes of {n0}, {n1}, {n2} bytes)")
        q = raw_len // 4
        b0, b1, b2 = head + n0, head + n0 + n1, head + n0 + n1 + n2
        stored = [payload[head:b0], payload[b0:b1], payload[b1:b2], payload[b2:]]
        for k, p in zip(kinds, stored):
            _check_plane(self.name, k, p, q)
        if out is not None and len(out) < raw_len:
            raise CodecError(f"decode buffer of {len(out)} bytes for {raw_len}")
        scratch = self._scratch_view(q * sum(kinds))
        dst = memoryview(bytearray(raw_len)) if out is None else out[:raw_len]
        if zstdlib.available() and zstdlib.DECOMPRESS_DCTX:
            with zstdlib.dctx() as d:
                rc = shufflelib.decode_planes4(stored, kinds, scratch, dst, d, zstdlib.DECOMPRESS_DCTX)
            if rc is not None:
                if rc:
                    raise CodecError(f"shuffle4-zstd plane {-rc - 1} does not decode to {q} bytes")
                return dst
        planes, used = [], 0
        for k, p in zip(kinds, stored):
            if k:
                self.zstd.decode_into(p, q, scratch[used:used + q])
                planes.append(scratch[used:used + q])
                used += q
            else:
                planes.append(p)
        if not shufflelib.merge4_views(planes, dst):  # numpy only where the C merge cannot take these views
            np = _np()
            arrays = [np.frombuffer(p, np.uint8) for p in planes]
            o = np.frombuffer(dst, "<u4")
            if not shufflelib.merge4(arrays, o):
                self._merge_numpy(arrays, o)
        return dst

    _BLOCK = 1 << 18  # elements per step of the numpy merge (its temporary stays small)

    def _merge_numpy(self, planes: list[np.ndarray], o: np.ndarray) -> None:
        """O's 4-byte elements from their PLANES with numpy, a block at a time: working memory one
        block's temporary, never another raw length (no C library, or an output it cannot take)."""
        np = _np()
        t = np.empty(min(self._BLOCK, o.size), "<u4")
        for s in range(0, o.size, self._BLOCK):
            e = min(o.size, s + self._BLOCK)
            seg, tmp = o[s:e], t[:e - s]
            seg[:] = planes[0][s:e]
            for i in (1, 2, 3):
                np.left_shift(planes[i][s:e], 8 * i, out=tmp, dtype="<u4")
                np.bitwise_or(seg, tmp, out=seg)


_RAW = RawCodec()
_ZSTD = ZstdCodec()
_SHUFFLE2 = Shuffle2Codec()
_SHUFFLE4 = Shuffle4Codec()


def _raw_decode(payload: memoryview, raw_len: int, out: memoryview | None) -> memoryview:
    return _RAW.decode(payload, raw_len)  # the view returned is PAYLOAD: nothing to copy


def _zstd_decode(payload: memoryview, raw_len: int, out: memoryview | None) -> bytes | memoryview:
    return _ZSTD.decode(payload, raw_len) if out is None else _ZSTD.decode_into(payload, raw_len, out)


CODECS: dict[int, CodecEntry] = {}
_cached: dict[str, tuple] = {}  # what host_codecs(), raw_entry_codecs() and choosable() answer (cleared by register)


_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.+-")


def register(entry: CodecEntry) -> None:
    """Add ENTRY to the registry. An id the format assigned keeps its name (FORMAT_IDS); a new id (a
    codec added since: FORMAT.md, "Codec ids") must be free, in 0..65535, and its name new and
    spelled as a `requires` entry allows (lowercase letters, digits, `.+-`, at most 64)."""
    fmt = FORMAT_IDS.get(entry.name)
    if fmt is not None and fmt != entry.id:
        raise CodecError(f"codec {entry.name!r} is not id {entry.id} in the format")
    if fmt is None:
        if entry.id in FORMAT_IDS.values():
            raise CodecError(f"codec id {entry.id} is {CODEC_NAMES[entry.id]!r} in the format, not {entry.name!r}")
        if not 0 <= entry.id <= 0xFFFF or not entry.name or len(entry.name) > 64 or \
                not set(entry.name) <= _NAME_OK or not entry.name[0].isalnum():
            raise CodecError(f"codec {entry.name!r} (id {entry.id}): not a codec id and name the format can hold")
        if CODEC_NAMES.get(entry.id, entry.name) != entry.name or CODEC_IDS.get(entry.name, entry.id) != entry.id:
            raise CodecError(f"codec {entry.name!r} (id {entry.id}) clashes with one registered already")
    if entry.where == "host" and entry.decode is None:
        raise CodecError(f"host codec {entry.name!r} without a decoder")
    CODECS[entry.id] = entry
    CODEC_IDS[entry.name] = entry.id
    CODEC_NAMES[entry.id] = entry.name
    _cached.clear()


def unregister(name: str) -> None:
    """Remove the codec NAME registered by `register` beyond the format's table (a test's toy codec, a
    plug-in unloaded); the format's own ids stay known."""
    cid = CODEC_IDS.get(name)
    if cid is None or name in FORMAT_IDS:
        raise CodecError(f"codec {name!r} is not a registered codec beyond the format's")
    del CODECS[cid], CODEC_IDS[name], CODEC_NAMES[cid]
    _cached.clear()


register(CodecEntry(0, "raw", "host", _RAW.encode, _raw_decode))
register(CodecEntry(1, "zstd", "host", _ZSTD.encode, _zstd_decode))
register(CodecEntry(2, "shuffle2-zstd", "host", _SHUFFLE2.encode, _SHUFFLE2.decode, choosable=_SHUFFLE2))
register(CodecEntry(4, "shuffle4-zstd", "host", _SHUFFLE4.encode, _SHUFFLE4.decode, choosable=_SHUFFLE4))


def nvcomp_importable() -> bool:
    """Whether nvCOMP's Python package is installed here (found, not imported: importing it is slow)."""
    try:
        return importlib.util.find_spec("nvidia.nvcomp") is not None
    except (ImportError, ValueError):
        return False


if nvcomp_importable():
    for _name, _algo in NVCOMP_ALGORITHMS.items():
        register(CodecEntry(FORMAT_IDS[_name], _name, "gpu", algorithm=_algo))


def host_codecs() -> tuple[str, ...]:
    """The host (CPU) codecs registered now, in id order: what a put, a repair or an encoder process
    may store a raw-addressed chunk as."""
    got = _cached.get("host")
    if got is None:
        got = _cached["host"] = tuple(e.name for _, e in sorted(CODECS.items()) if e.where == "host")
    return got


def raw_entry_codecs() -> tuple[str, ...]:
    """What a raw-addressed (GSNPCHK2) entry may be stored as: the host codecs, and a delta against a base."""
    got = _cached.get("raw")
    if got is None:
        got = _cached["raw"] = host_codecs() + (DELTA,)
    return got


def choosable() -> tuple[tuple[str, Choosable], ...]:
    """The codecs the per-chunk choice probes besides zstd, in id order."""
    got = _cached.get("choosable")
    if got is None:
        got = _cached["choosable"] = tuple((e.name, e.choosable) for _, e in sorted(CODECS.items())
                                           if e.choosable is not None)
    return got


def entry(name: str) -> CodecEntry:
    """The registered codec NAME; CodecError if the format has no such codec or this build lacks it."""
    cid = CODEC_IDS.get(name)
    if cid is None:
        raise CodecError(f"unknown chunk codec {name!r}")
    e = CODECS.get(cid)
    if e is None and name == DELTA:
        raise CodecError(f"chunk codec {name!r} is a delta: it decodes only against its base (storage/codecs/delta.py)")
    if e is None:
        raise CodecError(f"chunk codec {name!r} needs the GPU path (nvCOMP) to decode")
    return e


def gpu_codecs() -> tuple[str, ...]:
    """The GPU codecs registered here (nvCOMP importable), in id order: the first is the default."""
    return tuple(e.name for _, e in sorted(CODECS.items()) if e.where == "gpu")


# ----------------------------------------------------------------------------------- the choice
@dataclass(frozen=True)
class Encoded:
    codec: str
    payload: bytes | memoryview


def _sample_into(data: memoryview, dst: memoryview) -> memoryview:
    """SAMPLE_PIECES pieces of SAMPLE_PIECE bytes spread evenly over DATA, copied into DST, as one
    view (a chunk's data is often not uniform: a KV pool filled at scattered places starts with zeros)."""
    step = len(data) // SAMPLE_PIECES // 16 * 16  # each piece starts on an element of 2 or 4 bytes
    for i in range(SAMPLE_PIECES):
        dst[i * SAMPLE_PIECE:(i + 1) * SAMPLE_PIECE] = data[i * step:i * step + SAMPLE_PIECE]
    return dst[:SAMPLE_PIECES * SAMPLE_PIECE]


def _sample(data: memoryview) -> memoryview:
    """_sample_into a buffer of its own."""
    return _sample_into(data, memoryview(bytearray(SAMPLE_PIECES * SAMPLE_PIECE)))


@dataclass(frozen=True)
class _Probe:
    """What a chunk's sample favours (HostCodecChooser._probe): CODEC ("raw", "zstd", "shuffle2-zstd"
    or "shuffle4-zstd"), the sample's SIZE encoded so (its LENGTH for raw) and the byte-plane codec's
    PLANES (which of them pay zstd)."""

    codec: str
    size: int
    length: int
    planes: tuple[bool, ...] = ()


class HostCodecChooser:
    """Picks the codec for each host chunk: raw, zstd, or one of the registered Choosable codecs
    (shuffle2-zstd, shuffle4-zstd), by what each saves on a sample.

    The sample (SAMPLE_PIECES x SAMPLE_PIECE bytes, or the whole chunk when it is small) is
    compressed with zstd and probed with each Choosable codec whose width divides the length (an
    even length: shuffle2-zstd; a multiple of 4: shuffle4-zstd too); incompressible data (random,
    encrypted, already compressed) thus costs small probes instead of a full compression pass. The
    winner encodes the whole chunk, which is stored raw after all if it still does not pay: the
    output room is what would pay off (PAYS_OFF_RATIO), so a frame that would not fit stops there.
    """

    def __init__(self, level: int = ZSTD_LEVEL, compress: bool = True, shuffle: bool = True) -> None:
        self.zstd = _ZSTD if level == ZSTD_LEVEL else ZstdCodec(level)
        self.shuffle = shuffle
        self.compress = compress
        self._local = threading.local()

    def _buffers(self) -> tuple[memoryview, memoryview]:
        """This thread's sample buffer and the room its probes compress into: room for the largest
        sample, a chunk of up to 4 x SAMPLE_PIECES x SAMPLE_PIECE bytes probed whole."""
        b = getattr(self._local, "b", None)
        if b is None:
            n = SAMPLE_PIECES * SAMPLE_PIECE
            whole = memoryview(bytearray(n + 4 * n + 4096))
            b = self._local.b = (whole[:n], whole[n:])
        return b

    def _probe(self, data: memoryview, sample: memoryview | None = None, loose: bool = False,
               only: Collection[str] | None = None) -> _Probe:
        """What SAMPLE (by default DATA's: spread over it, or all of a chunk of up to 4 x
        SAMPLE_PIECES x SAMPLE_PIECE bytes) favours for DATA: zstd's probe (with room for what pays
        off, PAYS_OFF_RATIO of the sample, or LOOSE: for all of it), then each registered Choosable
        codec's (ONLY: those named) in id order, for a length that is a multiple of its width and
        where the best so far keeps more than its probe_above of the sample (shuffle2-zstd always,
        shuffle4-zstd above SHUFFLE4_PROBE_ABOVE); the smallest is taken if it is at most
        SHUFFLE_MIN_GAIN of zstd's; raw when none pays."""
        n = len(data)
        sbuf, room = self._buffers()
        if sample is None:
            sample = _sample_into(data, sbuf) if n > 4 * SAMPLE_PIECES * SAMPLE_PIECE else data
        s = len(sample)
        z = self.zstd.encode_into(sample, room[:s + 4096] if loose else room[:int(PAYS_OFF_RATIO * s)])
        best = _Probe("raw", s, s) if z is None else _Probe("zstd", z, s)
        if self.shuffle and s > 0:
            bar = SHUFFLE_MIN_GAIN * best.size
            for name, codec in choosable():
                if (only is not None and name not in only) or \
                        (codec.probe_above is not None and best.size <= codec.probe_above * s):
                    continue
                if n % codec.width == 0 and s % codec.width == 0:
                    planes, size = codec.probe(sample)
                    if any(planes) and size <= bar and (best.codec in ("raw", "zstd") or size < best.size):
                        best = _Probe(name, size, s, planes)
        return best

    def encode_into(self, data: memoryview, dst: memoryview) -> tuple[str, int]:
        """(codec, payload length) of DATA's chunk: "raw" (nothing written: the payload is DATA
        itself), or a payload written into DST (at least len(DATA) bytes), smaller than
        PAYS_OFF_RATIO of DATA. Nothing is allocated."""
        n = len(data)
        if not self.compress or n < MIN_COMPRESS:
            return "raw", n
        if len(dst) < n:
            raise CodecError(f"encode buffer of {len(dst)} bytes for {n}")
        p = self._probe(data)
        limit = dst[:int(PAYS_OFF_RATIO * n)]
        if p.codec == "raw":
            return "raw", n
        chosen = CODECS[CODEC_IDS[p.codec]].choosable
        if chosen is not None:
            m = chosen.encode_into(data, limit, p.planes)
            return ("raw", n) if m is None else (p.codec, m)
        m = self.zstd.encode_into(data, limit)
        return ("raw", n) if m is None else ("zstd", m)

    def estimate(self, data: memoryview) -> int:
        """The payload length encode_into would give DATA, from its sample alone (no pass over the
        whole chunk): a dump with a parent weighs a delta against it, and encodes the chunk only if
        no delta pays (FORMAT.md, "Delta entries"). DATA's length where it would be stored raw."""
        n = len(data)
        if not self.compress or n < MIN_COMPRESS:
            return n
        p = self._probe(data)
        return n if p.codec == "raw" else max(1, n * p.size // p.length)

    def encode_within(self, data: memoryview, dst: memoryview,
                      sample: memoryview | None = None) -> tuple[str, int] | None:
        """(codec, payload length) of DATA encoded into DST as "zstd" or "shuffle2-zstd", whichever
        SAMPLE (at most SAMPLE_PIECES x SAMPLE_PIECE bytes of DATA; by default spread over it as for
        encode_into) favours, as encode_into chooses; None when the payload does not fit in DST, whose
        length is the most it may take (a delta's XOR: storage/codecs/delta.py, its room what pays off; a
        delta's XOR is never shuffle4-zstd, FORMAT.md "Delta entries")."""
        p = self._probe(data, sample, loose=True, only=("shuffle2-zstd",))
        if p.codec == "shuffle2-zstd" and p.length <= SAMPLE_PIECES * SAMPLE_PIECE:
            # both planes tried: a sample of some pages says nothing of the rest (a delta's XOR
            # is zeros outside its changed pages, and zeros compress in either plane)
            m = _SHUFFLE2.encode_into(data, dst)
            return None if m is None else ("shuffle2-zstd", m)
        m = self.zstd.encode_into(data, dst)
        return None if m is None else ("zstd", m)

    def encode(self, data: memoryview) -> Encoded:
        """encode_into a buffer of its own (repair, tests)."""
        out = memoryview(bytearray(len(data)))
        codec, m = self.encode_into(data, out)
        return Encoded(codec, data if codec == "raw" else bytes(out[:m]))


def decode_host_into(codec: str, payload: memoryview, raw_len: int, out: memoryview) -> memoryview:
    """PAYLOAD decoded with no allocation for its output: a `raw` payload is its own bytes (the view
    returned is PAYLOAD), any other host codec decodes into OUT (at least RAW_LEN bytes)."""
    e = entry(codec)
    if e.where != "host" or e.decode is None:
        raise CodecError(f"chunk codec {codec!r} needs the GPU path (nvCOMP) to decode")
    got = e.decode(payload, raw_len, out)
    return got if isinstance(got, memoryview) else memoryview(got)


def decode_host(codec: str, payload: memoryview, raw_len: int) -> bytes | memoryview:
    """Decode a chunk payload on the CPU (exactly RAW_LEN bytes); GPU codecs are decoded by storage.pipeline.gpu_engine."""
    e = entry(codec)
    if e.where != "host" or e.decode is None:
        raise CodecError(f"chunk codec {codec!r} needs the GPU path (nvCOMP) to decode")
    return e.decode(payload, raw_len, None)
