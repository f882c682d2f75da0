"""The GPU data path: device regions into the store or the memory tier and back, compressed on the GPU.

checkpoint: region chunk --encode on the device--> --D2H into its landing place--> zero test --> hash (+ write)
restore:    payload (read + verify, or straight from the memory tier) --H2D--> --decode into the target region

Each of N lanes owns a stream, a pinned host frame (laid out like a chunk file, so the bytes the
device produced are written from where they landed), device scratch and output buffers and its own
codec (nvCOMP codecs are not thread-safe); lanes are allocated once per engine and reused.
Where the chunks land depends on the target: a SnapshotWriter (directory store: the lane's frame,
then a chunk file) or a memtier.PoolWriter (resident pinned pool: the D2H lands in the pool slot
itself, no further copy). A chunk is stored raw when compression does not pay, and as nothing when it
is all zeros: a chunk whose encoding equals the encoding of zeros of the same length decodes to zeros
(decoding is deterministic), so zero detection costs no extra kernel.

The device is a storage.gpu.device.Device: CudaDevice (the product: regions are device pointers valid in
this process, what cuCheckpointProcessCheckpoint's custom storage maps, or, on drivers without it,
another process's memory opened through CUDA IPC in tests and benchmarks) or HostDevice (host memory
standing in for device memory, zstd on the CPU: the same engine tested in CI without a GPU).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from storage.base.progress import Progress
from storage.format.chunkfile import HEADER_SIZE, ChunkError
from storage.codecs import registry as codecs
from storage.codecs.registry import GPU_PAYS_OFF_RATIO
from storage.base.limits import MAX_RAW_CHUNK
from storage.gpu.device import CudaDevice, Device, DeviceError, HostBuffer
from storage.fs.directio import ALIGN
from storage.format.manifest import ChunkRef, Manifest, Stream
from storage.pipeline.put import Result, Stages, _Failure, is_zero, writer_result
from storage.repo.tier import ChunkTier, TierWriter

GpuEngineError = DeviceError  # one exception type for the GPU data path (device.py raises it)


@dataclass(frozen=True)
class Region:
    """A named device region in this process's address space (one GPU's checkpoint memory)."""

    name: str
    dev_ptr: int
    size: int


def default_lanes() -> int:
    """1.5 lanes per core, 4..32: a lane spends much of its time waiting on the GPU, and the CPU work
    (hashing) needs the cores. 24 on the 16-core H200 machine, where 24 lanes measured a median 0.940 s
    memory-tier cycle against 0.966 s with 16 (BENCHMARKS.md)."""
    return min(32, max(4, (os.cpu_count() or 4) * 3 // 2))


class _Lane:
    def __init__(self, engine: "GpuEngine") -> None:
        dev = self.dev = engine.dev
        self.stream = dev.new_stream()
        self.frame: HostBuffer = dev.pinned(HEADER_SIZE + engine.chunk_size + ALIGN)
        self.scratch = dev.alloc(engine.chunk_size + (1 << 20))
        # nvCOMP leaves bytes of its output unwritten and copies unwritten scratch bytes into it
        # (measured, nvCOMP 6.0: ANS ~22 KB per 64 MiB chunk): a payload would carry whatever those
        # buffers held before (an earlier chunk, another snapshot's or tenant's data), and equal input
        # would not give equal bytes (no dedup, no zero signature). So every encode runs on zeroed
        # buffers: the output buffer here (memset on the lane's stream, _encode) and nvCOMP's scratch
        # (device._ScratchBuffer). scripts/device/probe_nvcomp_determinism.py (docs/history/README.md); BENCHMARKS.md.
        self.out_cap = codecs.nvcomp_out_bound(engine.chunk_size)
        self.out = dev.alloc(self.out_cap)
        self.codec = None if engine.codec == "raw" else dev.codec(engine.codec, self.stream, engine.nvcomp_chunk)

    def sync(self) -> None:
        self.dev.sync(self.stream)

    def close(self) -> None:
        dev = self.dev
        self.sync()
        self.codec = None  # nvCOMP's own buffers are freed here, while the context is alive
        dev.free(self.scratch)
        dev.free(self.out)
        dev.destroy_stream(self.stream)
        self.frame.close()


class GpuEngine:
    """Lanes of streams, pinned frames and codecs on one device; a context manager.

    device: a GPU index (CudaDevice) or a Device. codec: "raw" or one of the device's codecs
    (default: the device's first, nvcomp-ans on a GPU, zstd on the host stand-in).
    """

    def __init__(self, device: int | Device = 0, *, codec: str | None = None, chunk_size: int = 64 << 20,
                 lanes: int | None = None, nvcomp_chunk: int = 64 << 10) -> None:
        if chunk_size % ALIGN or not 0 < chunk_size <= MAX_RAW_CHUNK:
            raise GpuEngineError(f"chunk size must be a positive multiple of 4096, at most {MAX_RAW_CHUNK}")
        lanes = default_lanes() if lanes is None else lanes
        if lanes < 1:
            raise GpuEngineError("an engine needs at least one lane")
        self.dev: Device = CudaDevice(device) if isinstance(device, int) else device
        codec = codec or self.dev.codecs[0]
        if codec != "raw" and codec not in self.dev.codecs:
            raise GpuEngineError(f"unknown codec {codec!r} for {self.dev.name}; choose from raw, "
                                 f"{', '.join(self.dev.codecs)}")
        self.codec, self.chunk_size, self.nvcomp_chunk = codec, chunk_size, nvcomp_chunk
        self.device = getattr(self.dev, "index", 0)
        self.bind_thread()
        self._lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        self._all: list[_Lane] = []
        try:
            for _ in range(lanes):
                self._all.append(_Lane(self))
        except BaseException:
            self.close()
            raise
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

    @property
    def lanes_free(self) -> int:
        """Lanes not borrowed right now (all of them between operations: the staging pool accounting)."""
        return self._lanes.qsize()

    def bind_thread(self) -> None:
        self.dev.bind_thread()

    def close(self) -> None:
        self.bind_thread()
        for lane in self._all:
            lane.close()
        self._all.clear()
        # A CUDA device's primary context stays retained for the life of the process
        # (device.primary_context): nvCOMP keeps per-context state that must not outlive it.

    def __enter__(self) -> "GpuEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------
    def _encode(self, lane: _Lane, ptr: int, n: int) -> tuple[str, int, int]:
        """Encode N bytes at PTR on LANE; returns (codec, device pointer of the payload, its size)."""
        if lane.codec is None:
            return "raw", ptr, n
        self.dev.memset0(lane.out, lane.out_cap, lane.stream)
        m = lane.codec.encode(ptr, n, lane.out, lane.out_cap)
        if m > GPU_PAYS_OFF_RATIO * n or m > self.chunk_size:
            return "raw", ptr, n
        return self.codec, lane.out, m

    def _d2h(self, lane: _Lane, dst: int, src: int, m: int) -> None:
        self.dev.d2h(dst, src, m, lane.stream)
        lane.sync()
        if lane.codec is not None:
            lane.codec.release()

    def zero_signature(self, lane: _Lane, n: int) -> bytes | None:
        """The encoding of N zero bytes (computed once per length), or None for the raw codec."""
        if lane.codec is None:
            return None
        with self._zero_lock:
            sig = self._zero_sig.get(n)
        if sig is not None:
            return sig
        self.dev.memset0(lane.scratch, n, lane.stream)
        codec, src, m = self._encode(lane, lane.scratch, n)
        self._d2h(lane, lane.frame.ptr + HEADER_SIZE, src, m)
        # zeros that did not compress give b"\x00", which never matches a real payload length
        sig = b"\x00" if codec == "raw" else bytes(lane.frame.view[HEADER_SIZE:HEADER_SIZE + m])
        with self._zero_lock:
            self._zero_sig[n] = sig
        return sig

    def _is_zero_chunk(self, lane: _Lane, codec: str, ptr: int, n: int, payload: memoryview) -> tuple[bool, bool]:
        """(all zeros, whether LANE's frame was overwritten to find out). Exact: PAYLOAD equals the
        encoding of zeros, or (same size, other bytes) the raw chunk, copied into the frame, is all zeros."""
        if codec == "raw":
            return False, False
        sig = self._zero_sig.get(n)
        if sig is None or len(payload) != len(sig):
            return False, False
        if payload == sig:
            return True, False
        self._d2h(lane, lane.frame.ptr + HEADER_SIZE, ptr, n)
        return is_zero(lane.frame.view[HEADER_SIZE:HEADER_SIZE + n]), True

    def _checkpoint_chunk(self, lane: _Lane, target: TierWriter, ptr: int, n: int, stages: Stages) -> ChunkRef:
        t0 = time.perf_counter()
        codec, src, m = self._encode(lane, ptr, n)
        land = target.landing(lane.frame, m)
        try:
            self._d2h(lane, land.ptr, src, m)
            t1 = time.perf_counter()
            stages.add("encode+D2H", t1 - t0, n)
            zero, frame_used = self._is_zero_chunk(lane, codec, ptr, n, land.view)
            if zero:
                target.drop(land)
                return target.note_zero(n)
            if frame_used and land.frame is not None:  # the zero check overwrote the payload: fetch again
                codec, src, m = self._encode(lane, ptr, n)
                target.drop(land)
                land = target.landing(lane.frame, m)
                self._d2h(lane, land.ptr, src, m)
            pooled = land.frame is None
            ref = target.write(land, codec, n, m)
            stages.add("hash+index" if pooled else "hash+write", time.perf_counter() - t1, m)
            return ref
        except BaseException:
            target.drop(land)
            raise

    # -- checkpoint ----------------------------------------------------------------------------
    def checkpoint(self, writer: TierWriter, regions: list[Region], *, progress: Progress | None = None,
                   attrs: dict[str, Any] | None = None,
                   on_chunk: Callable[[str, int, ChunkRef], None] | None = None) -> Result:
        """Stream every region into WRITER (a store's SnapshotWriter or the memory tier's PoolWriter)
        as `blob` streams; the caller commits. ON_CHUNK(stream, index, ref) is told of each chunk once
        the writer has stored it (from the lane threads, in any order)."""
        stages = Stages()
        t_start = time.perf_counter()
        raw_total = 0
        # zero signatures for each chunk length we will meet, before the timed fan-out
        with self._lane() as lane0:
            for r in regions:
                for n in {min(self.chunk_size, r.size), r.size % self.chunk_size or self.chunk_size}:
                    if n:
                        self.zero_signature(lane0, n)

        def put(lane: _Lane, stream: Stream, idx: int, ptr: int, n: int) -> None:
            stream.chunks[idx] = ref = self._checkpoint_chunk(lane, writer, ptr, n, stages)
            if on_chunk is not None:
                on_chunk(stream.name, idx, ref)

        jobs: list[tuple[Callable[..., None], tuple[Any, ...], int]] = []
        for r in regions:
            s = Stream(r.name, {"type": "blob", "device": self.device, **(attrs or {}),
                                "chunker": {"name": "fixed", "size": self.chunk_size}})
            writer.add_stream(s)
            for idx, off in enumerate(range(0, r.size, self.chunk_size)):
                n = min(self.chunk_size, r.size - off)
                s.chunks.append(None)  # type: ignore[arg-type]
                jobs.append((put, (s, idx, r.dev_ptr + off, n), n))
            raw_total += r.size
        self._on_lanes(jobs, progress)
        return writer_result(writer, stages, time.perf_counter() - t_start, raw_total)  # type: ignore[arg-type]

    def _on_lanes(self, jobs: list[tuple[Callable[..., None], tuple[Any, ...], int]], progress: Progress | None) -> None:
        """Run every job FN(lane, *ARGS) on a borrowed lane, NBYTES of progress each; after the first
        failure the rest are skipped, and it is raised once all have ended."""
        fail = _Failure()

        def one(fn: Callable[..., None], args: tuple[Any, ...], nbytes: int) -> None:
            if fail.exc is not None:
                return
            try:
                with self._lane() as lane:
                    fn(lane, *args)
                if progress is not None:
                    progress.advance(nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                fail.set(e)

        with ThreadPoolExecutor(self.nlanes, thread_name_prefix="gpusnap-gpu", initializer=self.bind_thread) as ex:
            for f in [ex.submit(one, *job) for job in jobs]:
                f.result()
        fail.raise_if_set()

    # -- restore -------------------------------------------------------------------------------
    def _restore_chunk(self, lane: _Lane, source: ChunkTier, ref: ChunkRef, dst: int, stages: Stages) -> None:
        """One chunk into DST: memset for zeros, else the verified payload, H2D, and decode on the device."""
        dev = self.dev
        n = ref.raw_len
        if ref.is_zero:
            dev.memset0(dst, n, lane.stream)
            lane.sync()
            return
        t0 = time.perf_counter()
        got = source.read_verified(ref, lane.frame)
        if (got.header.codec, got.header.stored_len) != (ref.codec, ref.stored_len):
            # a GSNPCHK2 chunk encoded otherwise since (FORMAT.md): the device decodes by the reference
            raise ChunkError(ref.id or "", f"is encoded as {got.header.codec} in {got.header.stored_len} bytes, "
                             f"not as the snapshot says ({ref.codec}, {ref.stored_len})")
        src, stage = got.addr, got.stage
        del got
        stages.add(stage, time.perf_counter() - t0, ref.stored_len)
        t1 = time.perf_counter()
        if ref.codec == "raw":
            dev.h2d(dst, src, n, lane.stream)
        elif ref.codec in dev.codecs:
            if lane.codec is None:
                raise GpuEngineError("a raw-only engine cannot decode compressed chunks")
            dev.h2d(lane.scratch, src, ref.stored_len, lane.stream)
            lane.codec.decode(lane.scratch, ref.stored_len, dst, n)
        else:
            raise GpuEngineError(f"chunk codec {ref.codec!r} is not a codec of {dev.name}")
        lane.sync()
        if lane.codec is not None:
            lane.codec.release()
        stages.add("H2D+decode", time.perf_counter() - t1, n)

    def restore(self, source: ChunkTier, manifest: Manifest, targets: dict[str, Region], *,
                progress: Progress | None = None) -> Result:
        """Write every blob stream of MANIFEST (from a SnapshotStore or the memory tier) into the
        target region of the same name, every payload verified before it is used."""
        stages = Stages()
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
        missing = source.missing(manifest)
        if missing:
            raise source.error(f"snapshot {manifest.name!r} is damaged: {len(missing)} chunk(s) missing; "
                               "no GPU memory was written")

        def get(lane: _Lane, s: Stream, i: int, ref: ChunkRef, dst: int) -> None:
            try:
                self._restore_chunk(lane, source, ref, dst, stages)
            except ChunkError as e:
                raise source.error(f"snapshot {manifest.name!r} is damaged: {s.name} chunk {i}: {e.what}") from None

        jobs: list[tuple[Callable[..., None], tuple[Any, ...], int]] = []
        for s in streams:
            off = 0
            for i, c in enumerate(s.chunks):
                jobs.append((get, (s, i, c, targets[s.name].dev_ptr + off), c.raw_len))
                off += c.raw_len
        self._on_lanes(jobs, progress)
        stored = sum(c.stored_len for s in streams for c in s.chunks)
        return Result(sum(s.size for s in streams), stored, time.perf_counter() - t_start, stages)
