#!/usr/bin/env python3
"""Is nvCOMP's output a function of its input alone, and what does making it so cost?

Per algorithm (ANS, Bitcomp, LZ4), 64 MiB chunks of model-like bytes, nvCOMP's native format:
  baseline (nvCOMP's own allocator, the output buffer zeroed before each encode — the engine before
  the fix): encode X; encode Y (other bytes pass through the codec's buffers); fill the output with
  0xA5, zero it, encode X again: equal? And with the output left at 0xA5: how many bytes differ, how
  many of them are the fill byte (gaps nvCOMP never writes), does nvCOMP write past the size it reports?
  A fresh codec after another one; and 8 threads encoding 16 chunks twice in another order.
  fixed (storage.gpu.device's codec: every scratch buffer nvCOMP allocates zeroed before each encode):
  the same, then the cost per chunk of the memsets (output buffer, scratch) against the encode.
Prints one JSON document (and writes it to $OUT/probe-nvcomp-determinism.json when OUT is set);
PROBE_ONLY=baseline or fixed runs one half, PROBE_K=TEXT the steps whose name has TEXT.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from storage.codecs.registry import NVCOMP_ALGORITHMS
from storage.gpu.device import CudaDevice, DeviceBytes, _NvcompCodec, check_cuda, cuda_driver

N = 64 << 20
CAP = N * 3 // 2 + (4 << 20)  # the engine's lane output buffer (gpu_engine._Lane.out_cap)
NV_CHUNK = 64 << 10
d = cuda_driver()
dev = CudaDevice(0)


def model_bytes(seed: int) -> np.ndarray:
    """A quarter zeros, half bf16 weights, a quarter small integers (a serving process's memory)."""
    rng = np.random.default_rng(seed)
    q = N // 4
    w = (rng.normal(0, 0.02, q).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    ints = rng.integers(0, 50, q // 4, dtype=np.int32).view(np.uint8)
    return np.concatenate([np.zeros(q, np.uint8), w, ints])


def upload(a: np.ndarray) -> int:
    ptr = dev.alloc(a.nbytes)
    check_cuda(d.cuMemcpyHtoD(ptr, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
    return ptr


def download(ptr: int, n: int) -> np.ndarray:
    a = np.empty(n, np.uint8)
    check_cuda(d.cuMemcpyDtoH(a.ctypes.data, ptr, n), "cuMemcpyDtoH")
    return a


class Lane:
    def __init__(self, algo: str, fixed: bool) -> None:
        self.stream = dev.new_stream()
        self.out = dev.alloc(CAP)
        self.fixed = fixed
        self.algo = algo
        self.codec = self.new_codec()

    def new_codec(self) -> Any:
        if self.fixed:
            return _NvcompCodec(self.algo, self.stream, NV_CHUNK, 0)
        from nvidia import nvcomp
        return nvcomp.Codec(algorithm=self.algo, uncomp_chunk_size=NV_CHUNK, cuda_stream=int(self.stream), device_id=0)

    def fill(self, byte: int) -> None:
        check_cuda(d.cuMemsetD8Async(self.out, byte, CAP, self.stream), "cuMemsetD8Async")

    def encode(self, src: int, zero_out: bool = True) -> tuple[int, np.ndarray]:
        if zero_out:
            self.fill(0)
        if self.fixed:
            m = self.codec.encode(src, N, self.out, CAP)
        else:
            from nvidia import nvcomp
            enc = self.codec.encode(nvcomp.as_array(DeviceBytes(src, N)), out=nvcomp.as_array(DeviceBytes(self.out, CAP)))
            m = int(enc.buffer_size)
        dev.sync(self.stream)
        return m, download(self.out, m)


def uploads(into: list[int]) -> list[int]:
    """16 chunks of other bytes on the device (for the concurrent runs), made once."""
    into.extend(upload(model_bytes(10 + i)) for i in range(16))
    return into


def digest(a: np.ndarray) -> str:
    return hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()


def ndiff(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    return int(np.count_nonzero(a[:m] != b[:m])) + abs(len(a) - len(b))


def sequence(algo: str, fixed: bool, x: int, y: int) -> dict[str, Any]:
    lane = Lane(algo, fixed)
    m1, p1 = lane.encode(x)
    lane.encode(y)
    lane.fill(0xA5)
    m2, p2 = lane.encode(x)                  # output zeroed after the garbage: the engine's contract
    lane.fill(0xA5)
    m3, p3 = lane.encode(x, zero_out=False)  # output left full of 0xA5
    tail = download(lane.out + m3, min(CAP - m3, 8 << 20))
    gaps = np.nonzero(p3 != p1[:len(p3)])[0] if m3 == m1 else np.array([], np.int64)
    lane.encode(y)
    lane.codec = lane.new_codec()            # a fresh codec after another one encoded other bytes
    m4, p4 = lane.encode(x)
    r = {"size": m1, "after_other_chunk_same": m1 == m2 and bool((p1 == p2).all()), "ndiff_after_other": ndiff(p1, p2),
         "fresh_codec_same": m1 == m4 and bool((p1 == p4).all()), "ndiff_fresh_codec": ndiff(p1, p4),
         "unzeroed_out_ndiff": ndiff(p1, p3), "unzeroed_out_gap_bytes_0xA5": int((p3[gaps] == 0xA5).sum()) if len(gaps) else 0,
         "gap_offsets_first": gaps[:8].tolist(), "writes_past_reported_size": bool((tail != 0xA5).any())}
    if fixed:
        r["scratch_buffers"] = len(lane.codec.scratch)
        r["scratch_bytes"] = lane.codec.scratch_bytes
    return r


def concurrent(algo: str, fixed: bool, srcs: list[int], threads: int = 8) -> dict[str, Any]:
    """THREADS lanes encoding SRCS at once, twice in opposite orders: how many chunks give equal bytes."""
    lanes: queue.SimpleQueue[Lane] = queue.SimpleQueue()
    for _ in range(threads):
        lanes.put(Lane(algo, fixed))

    def one(i: int) -> str:
        lane = lanes.get()
        try:
            return digest(lane.encode(srcs[i])[1])
        finally:
            lanes.put(lane)

    with ThreadPoolExecutor(threads, initializer=dev.bind_thread) as ex:
        a = dict(zip(range(len(srcs)), ex.map(one, range(len(srcs)))))
        order = list(reversed(range(len(srcs))))
        b = dict(zip(order, ex.map(one, order)))
    return {"chunks": len(srcs), "equal_ids": sum(a[i] == b[i] for i in a)}


def timed(lane: Lane, src: int, reps: int = 10) -> dict[str, float]:
    """Milliseconds per chunk on the GPU (CUDA events): memset of the output buffer, of the codec's
    scratch (none for the baseline codec), the encode itself."""
    from nvidia import nvcomp
    ev = [check_cuda(d.cuEventCreate(0), "cuEventCreate") for _ in range(4)]
    tot = [0.0, 0.0, 0.0]
    fixed: _NvcompCodec | None = lane.codec if lane.fixed else None
    inner = fixed._codec if fixed is not None else lane.codec
    lane.encode(src)  # the first encode allocates nvCOMP's scratch: not timed
    for _ in range(reps):
        d.cuEventRecord(ev[0], lane.stream)
        lane.fill(0)
        d.cuEventRecord(ev[1], lane.stream)
        for b in list(fixed.scratch) if fixed is not None else []:
            check_cuda(d.cuMemsetD8Async(b.ptr, 0, b.size, lane.stream), "cuMemsetD8Async")
        d.cuEventRecord(ev[2], lane.stream)
        inner.encode(nvcomp.as_array(DeviceBytes(src, N)), out=nvcomp.as_array(DeviceBytes(lane.out, CAP)))
        d.cuEventRecord(ev[3], lane.stream)
        dev.sync(lane.stream)
        for k in range(3):
            tot[k] += float(check_cuda(d.cuEventElapsedTime(ev[k], ev[k + 1]), "cuEventElapsedTime"))
    out_ms, scr_ms, enc_ms = (t / reps for t in tot)
    scr_bytes = fixed.scratch_bytes if fixed is not None else 0
    return {"memset_out_ms": out_ms, "memset_out_bytes": CAP, "memset_out_GBps": CAP / out_ms / 1e6,
            "memset_scratch_ms": scr_ms, "memset_scratch_bytes": scr_bytes,
            "encode_ms": enc_ms, "encode_GBps": N / enc_ms / 1e6, "memset_share_of_encode": (out_ms + scr_ms) / enc_ms,
            "memset_ms_per_GB_input": (out_ms + scr_ms) * (1 << 30) / N}


def main() -> None:
    x, y = upload(model_bytes(1)), upload(model_bytes(2))
    many: list[int] = []
    res: dict[str, Any] = {"nvcomp_chunk": NV_CHUNK, "chunk": N, "out_cap": CAP}
    try:
        from nvidia import nvcomp
        res["nvcomp"] = nvcomp.__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        res["nvcomp"] = repr(e)
    steps: list[tuple[str, Callable[[], Any]]] = []
    modes = {"baseline": (False,), "fixed": (True,)}.get(os.environ.get("PROBE_ONLY", ""), (False, True))
    for fixed in modes:  # baseline first: the fixed codec installs nvCOMP's allocator for the process
        tag = "fixed" if fixed else "baseline"
        for algo in NVCOMP_ALGORITHMS.values():
            steps.append((f"{tag}/{algo}/sequence", lambda a=algo, f=fixed: sequence(a, f, x, y)))
            steps.append((f"{tag}/{algo}/concurrent", lambda a=algo, f=fixed: concurrent(a, f, many or uploads(many))))
            steps.append((f"{tag}/{algo}/cost", lambda a=algo, f=fixed: timed(Lane(a, f), x)))
    only = os.environ.get("PROBE_K")
    for name, fn in [s for s in steps if not only or only in s[0]]:
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - one failing step must not hide the others
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(res[name]), flush=True)
    text = json.dumps(res, indent=1)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe-nvcomp-determinism.json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
