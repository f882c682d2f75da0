"""The GPU data path: device regions into the store and back, compressed on the GPU by nvCOMP.

checkpoint: region chunk --nvCOMP encode (GPU)--> --D2H into a pinned frame--> zero test --> hash + write
restore:    read + verify into a pinned frame --H2D--> --nvCOMP decode straight into the target region

Each of N lanes owns a CUDA stream, a pinned host frame (laid out like a chunk file, so the bytes the
GPU produced are written from where they landed), a device scratch buffer and its own nvCOMP codec
(codecs are not thread-safe); lanes are allocated once per engine and reused for every chunk.
A chunk is stored raw when compression does not pay, and as nothing when it is all zeros: a
chunk whose encoding equals the encoding of zeros of the same length decodes to zeros (decoding is
deterministic), so zero detection costs no extra kernel.

The regions are device pointers valid in this process: what cuCheckpointProcessCheckpoint's custom
storage maps, or (tests and benchmarks on drivers without it) another process's memory opened
through CUDA IPC. Imports cuda.bindings and nvidia.nvcomp lazily; nothing here runs without a GPU.
"""
from __future__ import annotations

import ctypes
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from .chunkfile import HEADER_SIZE, ChunkError
from .directio import ALIGN, align_up
from .manifest import ChunkRef, Manifest, Stream
from .pipeline import Result, Stages, _Failure, is_zero, missing_chunks, writer_result
from .store import SnapshotStore, SnapshotWriter, StoreError

NVCOMP_ALGORITHMS = {"nvcomp-ans": "ANS", "nvcomp-bitcomp": "Bitcomp", "nvcomp-lz4": "LZ4"}
PAYS_OFF_RATIO = 0.97


class GpuEngineError(Exception):
    """A CUDA or nvCOMP call in the GPU data path failed, or the GPU path is unavailable here."""


def _drv() -> Any:
    try:
        from cuda.bindings import driver  # noqa: PLC0415
    except ImportError as e:
        raise GpuEngineError(f"the GPU data path needs cuda-bindings: {e}") from None
    return driver


def _nvcomp() -> Any:
    try:
        from nvidia import nvcomp  # noqa: PLC0415
    except ImportError as e:
        raise GpuEngineError(f"the GPU data path needs nvidia-nvcomp-cu13: {e}") from None
    return nvcomp


def _ck(out: Any, what: str) -> Any:
    err = out[0] if isinstance(out, tuple) else out
    if int(err) != 0:
        raise GpuEngineError(f"{what} failed: {getattr(err, 'name', err)}")
    if isinstance(out, tuple):
        return out[1] if len(out) == 2 else out[1:]
    return None


@dataclass(frozen=True)
class Region:
    """A named device region in this process's address space (one GPU's checkpoint memory)."""

    name: str
    dev_ptr: int
    size: int


class DeviceBytes:
    """A device pointer and length seen by nvCOMP as a uint8 array (CUDA array interface v3)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class PinnedBuffer:
    """Page-locked host memory from cuMemHostAlloc, exposed as a memoryview (DMA-able, O_DIRECT-able)."""

    def __init__(self, size: int) -> None:
        d = _drv()
        self.size = align_up(size)
        self.ptr = int(_ck(d.cuMemHostAlloc(self.size, 0), f"cuMemHostAlloc({self.size})"))
        if self.ptr % ALIGN:
            raise GpuEngineError("pinned allocation is not page aligned")
        self.view = memoryview((ctypes.c_char * self.size).from_address(self.ptr)).cast("B")

    def close(self) -> None:
        self.view.release()
        _drv().cuMemFreeHost(self.ptr)


_CONTEXTS: dict[int, Any] = {}
_CONTEXTS_LOCK = threading.Lock()


def primary_context(device: int) -> Any:
    """The device's primary context, retained once per process and kept (shared with nvCOMP/torch)."""
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(device)
        if ctx is None:
            d = _drv()
            dev = _ck(d.cuDeviceGet(device), "cuDeviceGet")
            ctx = _CONTEXTS[device] = _ck(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        return ctx


class _Lane:
    def __init__(self, engine: "GpuEngine") -> None:
        d = _drv()
        self._keep: Any = None
        self.frame_dirty = False
        self.stream = _ck(d.cuStreamCreate(1), "cuStreamCreate")  # non-blocking w.r.t. the null stream
        self.frame = PinnedBuffer(HEADER_SIZE + engine.chunk_size + ALIGN)
        self.scratch = int(_ck(d.cuMemAlloc(engine.chunk_size + (1 << 20)), "cuMemAlloc"))
        # nvCOMP leaves padding between its compressed blocks unwritten: encoding into a zeroed buffer
        # of the worst-case size (ANS asks for ~1.41x) keeps stale bytes out of chunks and makes
        # Bitcomp and LZ4 output equal for equal input, which dedup and the zero signature rely on.
        # ANS output still varies when several lanes encode at once (measured on nvCOMP 6.0.0.12:
        # scripts/probe_nvcomp_determinism.py, scripts/probe_engine_dedup.py), so ANS chunks seldom
        # dedup; choose nvcomp-bitcomp where dedup matters more than the ratio.
        self.out_cap = engine.chunk_size * 3 // 2 + (4 << 20)
        self.out = int(_ck(d.cuMemAlloc(self.out_cap), "cuMemAlloc"))
        self._algo = NVCOMP_ALGORITHMS.get(engine.codec)
        self._nvchunk, self._device = engine.nvcomp_chunk, engine.device
        self.codec = None if self._algo is None else self.new_codec()

    def new_codec(self) -> Any:
        return _nvcomp().Codec(algorithm=self._algo, uncomp_chunk_size=self._nvchunk,
                               cuda_stream=int(self.stream), device_id=self._device)

    def sync(self) -> None:
        _ck(_drv().cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def close(self) -> None:
        d = _drv()
        self.sync()
        self._keep = None
        self.codec = None  # nvCOMP's own buffers are freed here, while the context is alive
        d.cuMemFree(self.scratch)
        d.cuMemFree(self.out)
        d.cuStreamDestroy(self.stream)
        self.frame.close()


class GpuEngine:
    """Lanes of streams, pinned frames and codecs on one GPU; a context manager."""

    def __init__(self, device: int = 0, *, codec: str = "nvcomp-ans", chunk_size: int = 64 << 20,
                 lanes: int = 8, nvcomp_chunk: int = 64 << 10) -> None:
        if codec != "raw" and codec not in NVCOMP_ALGORITHMS:
            raise GpuEngineError(f"unknown GPU codec {codec!r}; choose from raw, {', '.join(NVCOMP_ALGORITHMS)}")
        if chunk_size % ALIGN:
            raise GpuEngineError("chunk size must be a multiple of 4096")
        d = _drv()
        try:
            init = d.cuInit(0)
        except Exception as e:  # noqa: BLE001 - no libcuda on this machine
            raise GpuEngineError(f"no NVIDIA driver here ({type(e).__name__})") from None
        _ck(init, "cuInit")
        self.device, self.codec, self.chunk_size, self.nvcomp_chunk = device, codec, chunk_size, nvcomp_chunk
        self.ctx = primary_context(device)
        self.bind_thread()
        self._lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        self._all = [_Lane(self) for _ in range(lanes)]
        for lane in self._all:
            self._lanes.put(lane)
        self.nlanes = lanes
        self._zero_sig: dict[int, bytes] = {}
        self._zero_lock = threading.Lock()

    @contextmanager
    def _lane(self) -> Iterator[_Lane]:
        """Borrow a lane (stream, pinned frame, scratch, codec) for one chunk; blocks while all are busy."""
        lane = self._lanes.get()
        try:
            yield lane
        finally:
            self._lanes.put(lane)

    def _fetch(self, lane: _Lane, ptr: int, n: int) -> tuple[str, int]:
        """Encode N bytes at PTR and copy the payload into LANE's frame; returns (codec, payload size)."""
        codec, src, m = self._encode(lane, ptr, n)
        _ck(_drv().cuMemcpyDtoHAsync(lane.frame.ptr + HEADER_SIZE, src, m, lane.stream), "cuMemcpyDtoHAsync")
        lane.sync()
        lane._keep = None
        lane.frame_dirty = False
        return codec, m

    def bind_thread(self) -> None:
        _ck(_drv().cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def close(self) -> None:
        self.bind_thread()
        for lane in self._all:
            lane.close()
        self._all.clear()
        # The primary context stays retained for the life of the process (primary_context):
        # nvCOMP keeps per-context state that must not outlive it.

    def __enter__(self) -> "GpuEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------
    def _encode(self, lane: _Lane, ptr: int, n: int) -> tuple[str, int, int]:
        """Encode N bytes at PTR on LANE; returns (codec, device pointer of the payload, its size)."""
        if lane.codec is None:
            return "raw", ptr, n
        nv = _nvcomp()
        _ck(_drv().cuMemsetD8Async(lane.out, 0, lane.out_cap, lane.stream), "cuMemsetD8Async")
        codec = lane.codec
        enc = codec.encode(nv.as_array(DeviceBytes(ptr, n)), out=nv.as_array(DeviceBytes(lane.out, lane.out_cap)))
        lane._keep = (enc, codec)  # both must outlive the stream work that follows
        m = int(enc.buffer_size)
        if m > PAYS_OFF_RATIO * n or m > self.chunk_size:
            return "raw", ptr, n
        return self.codec, lane.out, m

    def zero_signature(self, lane: _Lane, n: int) -> bytes | None:
        """The encoding of N zero bytes (computed once per length), or None for the raw codec."""
        if lane.codec is None:
            return None
        with self._zero_lock:
            sig = self._zero_sig.get(n)
        if sig is not None:
            return sig
        _ck(_drv().cuMemsetD8Async(lane.scratch, 0, n, lane.stream), "cuMemsetD8Async")
        codec, m = self._fetch(lane, lane.scratch, n)
        # zeros that did not compress give b"\x00", which never matches a real payload length
        sig = b"\x00" if codec == "raw" else bytes(lane.frame.view[HEADER_SIZE:HEADER_SIZE + m])
        with self._zero_lock:
            self._zero_sig[n] = sig
        return sig

    def _is_zero_chunk(self, lane: _Lane, codec: str, ptr: int, n: int, m: int) -> bool:
        """Exact: the payload equals the encoding of zeros, or (same size, other bytes) the raw chunk,
        copied to the host, is all zeros."""
        if codec == "raw":
            return False
        sig = self._zero_sig.get(n)
        if sig is None or m != len(sig):
            return False
        if bytes(lane.frame.view[HEADER_SIZE:HEADER_SIZE + m]) == sig:
            return True
        _ck(_drv().cuMemcpyDtoHAsync(lane.frame.ptr + HEADER_SIZE, ptr, n, lane.stream), "cuMemcpyDtoHAsync")
        lane.sync()
        lane.frame_dirty = True
        return is_zero(lane.frame.view[HEADER_SIZE:HEADER_SIZE + n])

    # -- checkpoint ----------------------------------------------------------------------------
    def checkpoint(self, writer: SnapshotWriter, regions: list[Region], *, progress: Any = None,
                   attrs: dict[str, Any] | None = None) -> Result:
        """Stream every region into WRITER as a `blob` stream (the caller commits)."""
        stages = Stages()
        fail = _Failure()
        t_start = time.perf_counter()
        raw_total = 0
        # zero signatures for each chunk length we will meet, before the timed fan-out
        with self._lane() as lane0:
            for r in regions:
                for n in {min(self.chunk_size, r.size), r.size % self.chunk_size or self.chunk_size}:
                    if n:
                        self.zero_signature(lane0, n)

        def one(stream: Stream, idx: int, ptr: int, n: int) -> None:
            if fail.exc is not None:
                return
            try:
                with self._lane() as lane:
                    t0 = time.perf_counter()
                    codec, m = self._fetch(lane, ptr, n)
                    t1 = time.perf_counter()
                    stages.add("encode+D2H", t1 - t0, n)
                    if self._is_zero_chunk(lane, codec, ptr, n, m):
                        stream.chunks[idx] = writer.note_zero(n)
                    else:
                        if lane.frame_dirty:  # the zero check used the frame: fetch the payload again
                            codec, m = self._fetch(lane, ptr, n)
                        stream.chunks[idx] = writer.put_chunk(codec, n, lane.frame.view, m)
                    stages.add("hash+write", time.perf_counter() - t1, m)
                if progress is not None:
                    progress.advance(n)
            except BaseException as e:  # noqa: BLE001
                fail.set(e)

        with ThreadPoolExecutor(self.nlanes, thread_name_prefix="gpusnap-gpu",
                                initializer=self.bind_thread) as ex:
            futs = []
            for r in regions:
                s = Stream(r.name, {"type": "blob", "device": self.device, **(attrs or {})})
                writer.add_stream(s)
                for idx, off in enumerate(range(0, r.size, self.chunk_size)):
                    n = min(self.chunk_size, r.size - off)
                    s.chunks.append(None)  # type: ignore[arg-type]
                    futs.append(ex.submit(one, s, idx, r.dev_ptr + off, n))
                raw_total += r.size
            for f in futs:
                f.result()
        fail.raise_if_set()
        return writer_result(writer, stages, time.perf_counter() - t_start, raw_total)

    # -- restore -------------------------------------------------------------------------------
    def _restore_chunk(self, lane: _Lane, store: SnapshotStore, ref: ChunkRef, dst: int, stages: Stages) -> None:
        """One chunk into DST: memset for zeros, else read + verify, H2D, and decode on the GPU."""
        d = _drv()
        n = ref.raw_len
        if ref.is_zero:
            _ck(d.cuMemsetD8Async(dst, 0, n, lane.stream), "cuMemsetD8Async")
            lane.sync()
            return
        t0 = time.perf_counter()
        store.read_chunk(ref, lane.frame)  # verified; payload at HEADER_SIZE
        t1 = time.perf_counter()
        stages.add("read+verify", t1 - t0, ref.stored_len)
        src = lane.frame.ptr + HEADER_SIZE
        if ref.codec == "raw":
            _ck(d.cuMemcpyHtoDAsync(dst, src, n, lane.stream), "cuMemcpyHtoDAsync")
        elif ref.codec in NVCOMP_ALGORITHMS:
            if lane.codec is None:
                raise GpuEngineError("a raw-only engine cannot decode nvCOMP chunks")
            _ck(d.cuMemcpyHtoDAsync(lane.scratch, src, ref.stored_len, lane.stream), "cuMemcpyHtoDAsync")
            _decode_into(_nvcomp(), lane, ref.stored_len, dst, n)
        else:
            raise GpuEngineError(f"chunk codec {ref.codec!r} is not a GPU codec")
        lane.sync()
        stages.add("H2D+decode", time.perf_counter() - t1, n)

    def restore(self, store: SnapshotStore, manifest: Manifest, targets: dict[str, Region], *,
                progress: Any = None) -> Result:
        """Write every blob stream of MANIFEST into the target region of the same name, verified."""
        stages = Stages()
        fail = _Failure()
        t_start = time.perf_counter()
        streams = [s for s in manifest.streams if s.attrs.get("type") == "blob"]
        for s in streams:
            t = targets.get(s.name)
            if t is None:
                raise GpuEngineError(f"no target region for stream {s.name!r}")
            if t.size < s.size:
                raise GpuEngineError(f"target region for {s.name!r} holds {t.size} bytes, snapshot has {s.size}")
            for c in s.chunks:
                if c.raw_len > self.chunk_size or c.stored_len > self.chunk_size:
                    raise GpuEngineError(f"snapshot chunks of {c.raw_len} bytes exceed this engine's "
                                         f"{self.chunk_size}-byte lanes; open the engine with a larger chunk size")
        missing = missing_chunks(store, manifest)
        if missing:
            raise StoreError(f"snapshot {manifest.name!r} is damaged: {len(missing)} chunk(s) missing; "
                             "no GPU memory was written")
        stored = 0

        def one(s: Stream, i: int, ref: ChunkRef, dst: int) -> None:
            if fail.exc is not None:
                return
            try:
                with self._lane() as lane:
                    self._restore_chunk(lane, store, ref, dst, stages)
                if progress is not None:
                    progress.advance(ref.raw_len)
            except ChunkError as e:
                fail.set(StoreError(f"snapshot {manifest.name!r} is damaged: {s.name} chunk {i}: {e.what}"))
            except BaseException as e:  # noqa: BLE001
                fail.set(e)

        with ThreadPoolExecutor(self.nlanes, thread_name_prefix="gpusnap-gpu",
                                initializer=self.bind_thread) as ex:
            futs = []
            for s in streams:
                off = 0
                for i, c in enumerate(s.chunks):
                    stored += c.stored_len
                    futs.append(ex.submit(one, s, i, c, targets[s.name].dev_ptr + off))
                    off += c.raw_len
            for f in futs:
                f.result()
        fail.raise_if_set()
        return Result(sum(s.size for s in streams), stored, time.perf_counter() - t_start, stages)


def _decode_into(nv: Any, lane: _Lane, stored: int, dst: int, n: int) -> None:
    """Decode LANE.scratch[:stored] into DST (N bytes) on the lane's stream, in place when nvCOMP can."""
    src = nv.as_array(DeviceBytes(lane.scratch, stored))
    try:
        lane.codec.decode(src, out=nv.as_array(DeviceBytes(dst, n)))  # type: ignore[union-attr]
        return
    except TypeError:
        pass  # an nvCOMP without external output buffers: decode, then copy on the device
    out = lane.codec.decode(src)  # type: ignore[union-attr]
    if int(out.buffer_size) != n:
        raise GpuEngineError(f"nvCOMP decoded {int(out.buffer_size)} bytes, expected {n}")
    ptr = int(out.__cuda_array_interface__["data"][0])
    _ck(_drv().cuMemcpyDtoDAsync(dst, ptr, n, lane.stream), "cuMemcpyDtoDAsync")
    lane.sync()
