"""Chunk codecs on the same data: the CPU codecs against nvCOMP fed from pinned host memory.

    python -m scripts.bench.bench_codecs [--mib 64] [--threads 1,16] [--json OUT] [--data weights,fp32,kv30,random,text]

Data (each --mib MiB): `weights` bf16 N(0, 0.02); `fp32` float32 N(0, 0.02); `kv30` a KV pool of 4 KiB pages, 30% of them (at
scattered places) holding bf16 values, the rest zeros; `random` bytes; `text` the Python standard
library's sources (the running interpreter's, in name order; repeated where --mib asks for more). Until
2026-12-05 `text` was this project's own sources and docs, which changed with every commit.

CPU rows, per 4 MiB chunk (the host path's chunk): zstd-1, shuffle2-zstd, shuffle4-zstd, `auto`
(storage.codecs.registry.HostCodecChooser: what `put` stores), and python-blosc2 SHUFFLE+ZSTD clevel 1
typesize 2 where blosc2 is importable. GB/s is raw bytes per second of wall time, with one thread
and with N threads for each N in --threads; the `cpu` columns of one-thread rows count that
thread's CPU seconds instead (a core's rate, whatever else the machine runs). CPU figures are the
best of 3 passes (a shared machine disturbs some); a `raw` chunk decodes to its own bytes (no
copy), so `auto` on random data shows no decode cost at all.

nvCOMP rows (ANS, GDeflate, LZ4, Bitcomp), where a GPU and nvCOMP are present: the data sits in
pinned host memory and goes through in 64 MiB batches on one stream: encode = copy in, compress,
copy the payload out; decode = copy the payload in, decompress, copy the raw bytes out (host-staged
bytes, what a restore between the driver's checkpoint and its restore has); the `dev` columns are
the device work alone. One more GPU row, `nvcomp-zstd(host frames)`: nvCOMP's Zstd decoding the
zstd frames the host path itself stores (storage.codecs.registry, unchanged format). Every decode is checked
byte for byte.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import zstandard

from storage.codecs import registry as C

CHUNK = 4 << 20
BATCH = 64 << 20
REPEATS = 3
NV_CHUNK = 64 << 10  # nvCOMP's own chunk (the GPU engine's default)
NVCOMP = {"ANS": "nvcomp-ans", "GDeflate": "nvcomp-gdeflate", "LZ4": "nvcomp-lz4", "Bitcomp": "nvcomp-bitcomp"}


def bf16(rng: np.random.Generator, n: int) -> np.ndarray:
    f = rng.normal(0, 0.02, n // 2).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def make_data(kind: str, n: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "weights":
        return bf16(rng, n)
    if kind == "fp32":
        return rng.normal(0, 0.02, n // 4).astype(np.float32).view(np.uint8)
    if kind == "kv30":
        out = np.zeros(n, np.uint8)
        pages = n // 4096
        filled = rng.choice(pages, int(pages * 0.3), replace=False)
        vals = bf16(rng, len(filled) * 4096).reshape(-1, 4096)
        out.reshape(-1, 4096)[filled] = vals
        return out
    if kind == "random":
        return np.frombuffer(rng.bytes(n), np.uint8).copy()
    if kind == "text":
        # source text that does not change with this project's own files (those made the sample, and a
        # test's tolerance, move with every commit): the interpreter's standard library, in name order
        root = pathlib.Path(os.__file__).resolve().parent
        text = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")))
        reps = n // len(text) + 1
        return np.frombuffer((text * reps)[:n], np.uint8).copy()
    raise SystemExit(f"unknown data {kind!r}")


# ----------------------------------------------------------------------------------------- CPU
class CpuCodec:
    """encode(chunk) -> payload; decode(payload, raw_len, out) -> view of out (or own bytes)."""

    def __init__(self, name: str, encode: Callable[[memoryview], Any], decode: Callable[[Any, int, memoryview], Any]):
        self.name, self.encode, self.decode = name, encode, decode


def cpu_codecs() -> list[CpuCodec]:
    z = C.ZstdCodec(1)
    sh = C.Shuffle2Codec()
    sh4 = C.Shuffle4Codec()
    chooser = C.HostCodecChooser()
    rows = [
        CpuCodec("zstd-1", z.encode, lambda p, n, out: z.decode_into(memoryview(p), n, out)),
        CpuCodec("shuffle2-zstd", lambda d: sh.encode(d, sh.probe(C._sample(d) if len(d) > (1 << 18) else d)[0]),
                 lambda p, n, out: sh.decode(memoryview(p), n, out)),
        CpuCodec("shuffle4-zstd", lambda d: sh4.encode(d, sh4.probe(C._sample(d) if len(d) > (1 << 18) else d)[0]),
                 lambda p, n, out: sh4.decode(memoryview(p), n, out)),
        CpuCodec("auto", lambda d: chooser.encode(d),
                 lambda e, n, out: C.decode_host_into(e.codec, memoryview(e.payload), n, out)),
    ]
    try:
        import blosc2  # noqa: PLC0415 - optional: only for the comparison
    except ImportError:
        return rows
    blosc2.set_nthreads(1)
    kw = {"codec": blosc2.Codec.ZSTD, "clevel": 1, "typesize": 2, "filters": [blosc2.Filter.SHUFFLE], "nthreads": 1}

    def bdec(p: bytes, n: int, out: memoryview) -> memoryview:
        nbytes, _, _ = blosc2.get_cbuffer_sizes(p)
        if nbytes != n:
            raise C.CodecError("blosc2 chunk of another raw length")
        blosc2.decompress2(p, dst=out[:n])
        return out[:n]
    rows.append(CpuCodec("blosc2-shuffle-zstd", lambda d: blosc2.compress2(bytes(d), **kw), bdec))
    return rows


def _size(p: Any) -> int:
    return len(p.payload) if isinstance(p, C.Encoded) else len(p)


def bench_cpu(codec: CpuCodec, data: np.ndarray, threads: int) -> dict[str, Any]:
    view = memoryview(data)
    chunks = [view[i:i + CHUNK] for i in range(0, len(view), CHUNK)]
    local = threading.local()

    def out() -> memoryview:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty(CHUNK, np.uint8)
        return memoryview(buf)

    cpu_best = {"enc": float("inf"), "dec": float("inf")}

    def run(fn: Callable[[int], Any], what: str) -> tuple[float, list[Any]]:
        """The best of REPEATS passes (the machine may be shared: the best is the least disturbed);
        with one thread, also the best thread CPU time (what a core costs, whatever else runs)."""
        best, res = float("inf"), []
        with ThreadPoolExecutor(threads) as ex:
            for _ in range(REPEATS):
                t0, c0 = time.perf_counter(), time.thread_time()
                res = [fn(i) for i in range(len(chunks))] if threads == 1 else list(ex.map(fn, range(len(chunks))))
                best = min(best, time.perf_counter() - t0)
                cpu_best[what] = min(cpu_best[what], time.thread_time() - c0)
        return best, res

    enc_s, payloads = run(lambda i: codec.encode(chunks[i]), "enc")
    stored = sum(_size(p) for p in payloads)
    exact = all(bytes(codec.decode(p, len(c), out())) == bytes(c) for p, c in zip(payloads, chunks))
    dec_s, _ = run(lambda i: codec.decode(payloads[i], len(chunks[i]), out()), "dec")
    n = len(data)
    row = {"codec": codec.name, "where": "cpu", "threads": threads, "ratio": round(n / stored, 3),
           "encode_gbps": round(n / enc_s / 1e9, 3), "decode_gbps": round(n / dec_s / 1e9, 3), "exact": exact,
           "codecs_chosen": _chosen(payloads)}
    if threads == 1:  # per core: raw bytes per CPU second of the one thread
        row["encode_gbps_cpu"] = round(n / max(cpu_best["enc"], 1e-9) / 1e9, 3)
        row["decode_gbps_cpu"] = round(n / max(cpu_best["dec"], 1e-9) / 1e9, 3)
    return row


def _chosen(payloads: list[Any]) -> dict[str, int] | None:
    if not payloads or not isinstance(payloads[0], C.Encoded):
        return None
    out: dict[str, int] = {}
    for p in payloads:
        out[p.codec] = out.get(p.codec, 0) + 1
    return out


# ----------------------------------------------------------------------------------------- GPU
def gpu_present() -> str | None:
    """None when nvCOMP rows can run here, else why not."""
    if not C.nvcomp_importable():
        return "nvCOMP is not installed"
    try:
        from storage.gpu.device import CudaDevice  # noqa: PLC0415
        CudaDevice(0)
    except Exception as e:  # noqa: BLE001 - any reason: no driver, no device
        return f"no GPU ({e})"
    return None


def bench_nvcomp(algo: str, data: np.ndarray) -> dict[str, Any]:
    from storage.gpu.device import CudaDevice, PinnedBuffer, _NvcompCodec, check_cuda, cuda_driver  # noqa: PLC0415
    d = cuda_driver()
    dev = CudaDevice(0)
    n = len(data)
    batch = min(BATCH, n)
    cap = C.nvcomp_out_bound(batch)
    src = PinnedBuffer(n)
    np.frombuffer(src.view, np.uint8, n)[:] = data
    back = PinnedBuffer(n)
    staged = PinnedBuffer(cap * (n // batch + 1))  # the payloads, host-staged
    stream = dev.new_stream()
    d_raw, d_out = dev.alloc(batch), dev.alloc(cap)
    codec = _NvcompCodec(algo, stream, NV_CHUNK, 0)
    sizes: list[int] = []
    enc_dev = dec_dev = 0.0
    try:
        dev.sync(stream)
        t0 = time.perf_counter()
        off = 0
        for i in range(0, n, batch):
            k = min(batch, n - i)
            dev.h2d(d_raw, src.ptr + i, k, stream)
            dev.sync(stream)
            t1 = time.perf_counter()
            m = codec.encode(d_raw, k, d_out, cap)
            dev.sync(stream)
            enc_dev += time.perf_counter() - t1
            dev.d2h(staged.ptr + off, d_out, m, stream)
            dev.sync(stream)
            codec.release()
            sizes.append(m)
            off += m
        enc_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        off = 0
        for j, i in enumerate(range(0, n, batch)):
            k, m = min(batch, n - i), sizes[j]
            dev.h2d(d_out, staged.ptr + off, m, stream)
            dev.sync(stream)
            t1 = time.perf_counter()
            codec.decode(d_out, m, d_raw, k)
            dev.sync(stream)
            dec_dev += time.perf_counter() - t1
            dev.d2h(back.ptr + i, d_raw, k, stream)
            dev.sync(stream)
            codec.release()
            off += m
        dec_s = time.perf_counter() - t0
        exact = bool(np.array_equal(np.frombuffer(back.view, np.uint8, n), data))
    finally:
        del codec  # its buffers go while the context lives
        dev.free(d_raw)
        dev.free(d_out)
        dev.destroy_stream(stream)
        for b in (src, back, staged):
            b.close()
        check_cuda(d.cuCtxSynchronize(), "cuCtxSynchronize")
    stored = sum(sizes)
    return {"codec": NVCOMP[algo], "where": "gpu", "threads": 1, "ratio": round(n / stored, 3),
            "encode_gbps": round(n / enc_s / 1e9, 3), "decode_gbps": round(n / dec_s / 1e9, 3),
            "encode_dev_gbps": round(n / enc_dev / 1e9, 3), "decode_dev_gbps": round(n / dec_dev / 1e9, 3),
            "exact": exact}


def host_frames(data: np.ndarray) -> tuple[list[bytes], list[bytes]]:
    """The zstd frames the host path stores for DATA (`auto` per 4 MiB chunk: a zstd chunk's frame,
    a shuffle2-zstd or shuffle4-zstd chunk's zstd planes) and what each decodes to."""
    chooser = C.HostCodecChooser()
    frames, raws = [], []
    view = memoryview(data)
    for i in range(0, len(view), CHUNK):
        e = chooser.encode(view[i:i + CHUNK])
        p = memoryview(e.payload)
        if e.codec == "zstd":
            frames.append(bytes(p))
            raws.append(bytes(view[i:i + CHUNK]))
        elif e.codec == "shuffle2-zstd":
            layout, k0, k1, n0 = C.Shuffle2Codec._HEAD.unpack_from(p)
            body = p[C.Shuffle2Codec._HEAD.size:]
            h = len(view[i:i + CHUNK]) // 2
            planes = np.empty(2 * h, np.uint8)
            C.Shuffle2Codec().split(view[i:i + CHUNK], planes, layout)
            for k, part, plane in ((k0, body[:n0], planes[:h]), (k1, body[n0:], planes[h:])):
                if k == 1:
                    frames.append(bytes(part))
                    raws.append(plane.tobytes())
        elif e.codec == "shuffle4-zstd":
            _, *rest = C.Shuffle4Codec._HEAD.unpack_from(p)
            kinds, lens = rest[:4], rest[4:]
            at = [C.Shuffle4Codec._HEAD.size]
            for n in lens:
                at.append(at[-1] + n)
            at.append(len(p))
            elems = np.frombuffer(view[i:i + CHUNK], "<u4")
            for j, k in enumerate(kinds):
                if k == 1:
                    frames.append(bytes(p[at[j]:at[j + 1]]))
                    raws.append((elems >> np.uint32(8 * j)).astype(np.uint8).tobytes())
    return frames, raws


def bench_nvcomp_zstd_host(data: np.ndarray) -> dict[str, Any]:
    """nvCOMP's Zstd (RAW bitstream) decoding the host path's own zstd frames, batched per 64 MiB of
    raw bytes, from pinned host memory and back: whether a free GPU could decode stored host chunks
    with no change of format. Rates count the frames' raw bytes; the byte-plane merge of
    shuffle2-zstd chunks (a memory-bound elementwise kernel) is not included."""
    from nvidia import nvcomp  # noqa: PLC0415
    from storage.gpu.device import CudaDevice, DeviceBytes, PinnedBuffer  # noqa: PLC0415
    frames, raws = host_frames(data)
    if not frames:
        raise RuntimeError("no zstd frames in this data (stored raw)")
    dev = CudaDevice(0)
    stream = dev.new_stream()
    total_c, total_r = sum(map(len, frames)), sum(map(len, raws))
    src, back = PinnedBuffer(total_c), PinnedBuffer(total_r)
    offs, off = [], 0
    for f in frames:
        src.view[off:off + len(f)] = f
        offs.append(off)
        off += len(f)
    d_src = dev.alloc(total_c)
    codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=int(stream),
                         device_id=0, uncomp_chunk_size=CHUNK)
    how: list[str] = []

    def batch_decode(arrays: list[Any]) -> list[Any]:
        """ARRAYS decoded in one batched call where this nvCOMP can make a BatchArray of them, else one
        call per frame (the row says which: `how`)."""
        make = getattr(nvcomp, "as_arrays", None) or getattr(nvcomp, "BatchArray", None)
        if make is not None:
            try:
                out = list(codec.decode(make(arrays)))
                how[:] = ["batched"]
                return out
            except TypeError:
                pass
        how[:] = ["per frame"]
        return [codec.decode(a) for a in arrays]

    try:
        batches, cur, acc = [], [], 0
        for j, r in enumerate(raws):
            cur.append(j)
            acc += len(r)
            if acc >= BATCH:
                batches.append(cur)
                cur, acc = [], 0
        if cur:
            batches.append(cur)
        t0 = time.perf_counter()
        dev_s = 0.0
        roff = 0
        for b in batches:
            lo, hi = offs[b[0]], offs[b[-1]] + len(frames[b[-1]])
            dev.h2d(d_src + lo, src.ptr + lo, hi - lo, stream)
            dev.sync(stream)
            t1 = time.perf_counter()
            outs = batch_decode([nvcomp.as_array(DeviceBytes(d_src + offs[j], len(frames[j]))) for j in b])
            dev.sync(stream)
            dev_s += time.perf_counter() - t1
            for j, o in zip(b, outs):
                n = int(o.buffer_size)
                if n != len(raws[j]):
                    raise RuntimeError(f"nvCOMP Zstd decoded {n} bytes, expected {len(raws[j])}")
                dev.d2h(back.ptr + roff, int(o.__cuda_array_interface__["data"][0]), n, stream)
                roff += n
            dev.sync(stream)
            del outs
        secs = time.perf_counter() - t0
        exact = bytes(back.view[:total_r]) == b"".join(raws)
    finally:
        del codec
        dev.free(d_src)
        dev.destroy_stream(stream)
        src.close()
        back.close()
    return {"codec": "nvcomp-zstd(host frames)", "where": "gpu", "threads": 1, "ratio": round(total_r / total_c, 3),
            "encode_gbps": 0.0, "decode_gbps": round(total_r / secs / 1e9, 3),
            "decode_dev_gbps": round(total_r / dev_s / 1e9, 3), "frames": len(frames), "exact": exact,
            "calls": how[0] if how else "none"}


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB of each data set (a multiple of 4)")
    ap.add_argument("--data", default="weights,fp32,kv30,random,text")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts for the CPU rows")
    ap.add_argument("--no-gpu", action="store_true", help="CPU rows only")
    ap.add_argument("--json", help="write every row here")
    a = ap.parse_args(argv)
    n = max(4, a.mib - a.mib % 4) << 20
    threads = [int(t) for t in a.threads.split(",")]
    why_not = "--no-gpu" if a.no_gpu else gpu_present()
    rows: list[dict[str, Any]] = []
    machine = {"cpu": _cpu_name(), "cores": os.cpu_count(), "zstandard": zstandard.__version__,
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nvcomp": why_not or "yes"}
    print(f"# {machine}", flush=True)
    print(f"{'data':8} {'codec':24} {'where':5} {'thr':>3} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} "
          f"{'cpu/dev enc':>11} {'cpu/dev dec':>11} exact", flush=True)
    for kind in a.data.split(","):
        data = make_data(kind, n)
        todo: list[Callable[[], dict[str, Any]]] = []
        for c in cpu_codecs():
            for t in threads:
                todo.append(lambda c=c, t=t: bench_cpu(c, data, t))
        if why_not is None:
            for algo in NVCOMP:
                todo.append(lambda algo=algo: bench_nvcomp(algo, data))
            if kind != "random":
                todo.append(lambda: bench_nvcomp_zstd_host(data))
        for job in todo:
            try:
                r = job()
            except Exception as e:  # noqa: BLE001 - one failing row is reported, the others still run
                print(f"{kind:8} failed: {type(e).__name__}: {e}", flush=True)
                continue
            r["data"] = kind
            rows.append(r)
            enc2 = r.get("encode_dev_gbps", r.get("encode_gbps_cpu", ""))
            dec2 = r.get("decode_dev_gbps", r.get("decode_gbps_cpu", ""))
            print(f"{kind:8} {r['codec']:24} {r['where']:5} {r['threads']:>3} {r['ratio']:>6} {r['encode_gbps']:>9} "
                  f"{r['decode_gbps']:>9} {enc2:>11} {dec2:>11} "
                  f"{r['exact']}" + (f"  {r['codecs_chosen']}" if r.get("codecs_chosen") else ""), flush=True)
    verdict = decode_verdict(rows, max(threads))
    for line in verdict:
        print("# " + line)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"machine": machine, "rows": rows, "verdict": verdict}, indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


def decode_verdict(rows: list[dict[str, Any]], threads: int) -> list[str]:
    """Per data set: the CPU's `auto` decode at THREADS threads against the best nvCOMP host-to-host
    decode, and which would restore host-staged bytes faster."""
    out = []
    for kind in dict.fromkeys(r["data"] for r in rows):
        cpu = [r for r in rows if r["data"] == kind and r["codec"] == "auto" and r["threads"] == threads]
        gpu = [r for r in rows if r["data"] == kind and r["where"] == "gpu"]
        if not cpu or not gpu:
            continue
        best = max((r for r in gpu if r["codec"].startswith("nvcomp-") and "(" not in r["codec"]),
                   key=lambda r: r["decode_gbps"])
        c = cpu[0]
        out.append(f"{kind}: CPU auto {c['decode_gbps']} GB/s at ratio {c['ratio']} ({threads} threads) vs "
                   f"{best['codec']} {best['decode_gbps']} GB/s host-to-host at ratio {best['ratio']}: "
                   f"{'nvCOMP' if best['decode_gbps'] > c['decode_gbps'] else 'CPU'} decodes faster")
        for h in (r for r in gpu if "(host frames)" in r["codec"]):
            out.append(f"{kind}: nvCOMP Zstd decodes the host path's own frames at {h['decode_gbps']} GB/s host-to-host "
                       f"({h['decode_dev_gbps']} on the device), exact {h['exact']}")
    return out


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    sys.exit(main())
