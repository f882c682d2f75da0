#!/usr/bin/env python3
"""The host path's three costs apart, with the disk's floors measured in the same run.

1. codecs: the per-chunk codec choice (storage.codecs.registry.HostCodecChooser, what every put stores)
   encoding and decoding 4 MiB chunks on 1..N threads, through libzstd into our own buffers
   (storage/codecs/zstdlib.py) and, in a child process with GPUSNAP_NO_LIBZSTD=1, through python-zstandard;
2. ingest: a page image pushed through a pipe (as `criu dump --stream` does) into a store on disk with
   the page chunker, durable (packs fsynced) - wall time against the write floor for the bytes stored;
3. read: that snapshot read back cold through the read stage, in restore order and in pack order
   (what the split fill uses), and one chunk at a time from many threads (what the fill did before)
   - wall time against the cold read floor for the bytes stored.

The image: `weights` (bf16 N(0, 0.02), 5% zeros: a weights-dominated process) or `serving` (the
realistic mix of scripts/bench/bench_ingest.py: 40% bf16, 55% zeros, 5% random); every page distinct,
so nothing deduplicates.
Usage: python3 -m scripts.bench.bench_hostpath [--gb 8] [--mix weights] [--threads 1,8,16] [--dir D] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from scripts.helpers import child_env, disk_floor, drop_caches, report_json
from storage.pipeline import put as pipeline
from storage.codecs import registry as codecs
from storage.codecs import zstdlib
from storage.fs.directio import AlignedBuffer, BufferPool
from storage.pipeline.put import StreamSpec
from storage.repo.readstage import Want, read_chunks
from storage.repo.store import SnapshotStore

CHUNK = 4 << 20
RUN = 64 << 20


def make_image(path: str, gb: float, mix: str) -> int:
    """A page-image-like file of GB gigabytes of MIX at PATH (see the module doc); its size."""
    if mix == "serving":
        from scripts.bench.bench_ingest import make_image as serving  # noqa: PLC0415
        return serving(path, gb)
    rng = np.random.default_rng(7)
    bf16 = (rng.normal(0, 0.02, RUN // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    n = int(gb * 1e9) // RUN
    with open(path, "wb") as f:
        for i in range(n):
            if i % 20 == 19:
                f.write(bytes(RUN))
                continue
            a = bf16.view(np.uint64).copy()
            a[::512] += np.uint64(i + 1)  # one word per page: no two pages equal across runs
            f.write(a.tobytes())
    return n * RUN


# ------------------------------------------------------------------------------------------ codecs
def codec_rates(path: str, threads: list[int], mib: int = 512) -> list[dict[str, Any]]:
    """Encode and decode GB/s of the first MIB MiB of PATH in 4 MiB chunks, per thread count."""
    with open(path, "rb") as f:
        data = f.read(mib << 20)
    chunks = [memoryview(data)[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    chooser = codecs.HostCodecChooser()
    rows = []
    for t in threads:
        outs = [memoryview(bytearray(CHUNK)) for _ in chunks]
        got: list[tuple[str, int]] = [("", 0)] * len(chunks)

        def enc(i: int) -> None:
            got[i] = chooser.encode_into(chunks[i], outs[i])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(t) as ex:
            list(ex.map(enc, range(len(chunks))))
        e = time.perf_counter() - t0
        back = [memoryview(bytearray(CHUNK)) for _ in range(t)]
        local = threading.local()
        ids = iter(range(t))
        lock = threading.Lock()

        def dec(i: int) -> None:
            if not hasattr(local, "b"):
                with lock:
                    local.b = back[next(ids)]
            codec, m = got[i]
            payload = chunks[i] if codec == "raw" else outs[i][:m]
            codecs.decode_host_into(codec, payload, len(chunks[i]), local.b)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(t) as ex:
            list(ex.map(dec, range(len(chunks))))
        d = time.perf_counter() - t0
        stored = sum(m for _, m in got)
        rows.append({"threads": t, "encode_GBps": round(len(data) / e / 1e9, 3),
                     "decode_GBps": round(len(data) / d / 1e9, 3), "ratio": round(len(data) / stored, 3),
                     "codecs": {c: sum(1 for g in got if g[0] == c) for c in {g[0] for g in got}}})
    return rows


# ------------------------------------------------------------------------------------------ ingest
class PipeSource:
    """One page image read from a pipe that a thread fills from PATH with splice (CRIU's way)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def streams(self) -> Iterator[StreamSpec]:
        yield StreamSpec("images", {"type": "dir", "mode": 0o700, "mtime_ns": 0}, 0)
        yield StreamSpec("images/pages-1.img", {"type": "file", "mode": 0o600, "mtime_ns": 0}, None)

    @contextmanager
    def open(self, spec: StreamSpec) -> Iterator[Any]:
        r, w = os.pipe()
        import fcntl  # noqa: PLC0415
        for size in (16 << 20, 1 << 20):  # F_SETPIPE_SZ, as the streamer sets CRIU's pipes
            try:
                fcntl.fcntl(w, 1031, size)
                break
            except OSError:
                continue

        def push() -> None:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                while os.splice(fd, w, 1 << 20):
                    pass
            finally:
                os.close(fd)
                os.close(w)

        th = threading.Thread(target=push, daemon=True)
        th.start()

        class Reader:
            def readinto(self, view: memoryview) -> int:
                done = 0
                while done < len(view):
                    n = os.readv(r, [view[done:]])
                    if n == 0:
                        break
                    done += n
                return done

        try:
            yield Reader()
        finally:
            th.join()
            os.close(r)


def ingest(store_dir: str, image: str, workers: int | None, chunker: str = "pages") -> tuple[dict[str, Any], SnapshotStore]:
    st = SnapshotStore(store_dir)
    os.sync()
    t0 = time.perf_counter()
    with st.writer("i") as w:
        res = pipeline.put(w, PipeSource(image), chunker=chunker, workers=workers)
        w.commit()
    wall = time.perf_counter() - t0
    size = os.path.getsize(image)
    return {"wall_s": round(wall, 3), "GBps": round(size / wall / 1e9, 3), "stored_gb": round(res.stored_bytes / 1e9, 3),
            "workers": workers or pipeline.put_workers(), "stages": res.stages.table()}, st


# ------------------------------------------------------------------------------------------- reads
def read_back(st: SnapshotStore, how: str, workers: int) -> dict[str, Any]:
    m = st.load("i")
    refs = [c for s in m.streams for c in s.chunks if not c.is_zero]
    stored = sum(c.stored_len for c in refs)
    raw = sum(c.raw_len for c in refs)
    drop_caches(required=True)
    times = pipeline.Stages()
    sink = [0]
    lock = threading.Lock()

    def deliver(w: Want, data: Any) -> None:
        with lock:
            sink[0] += len(data)

    t0 = time.perf_counter()
    if how in ("given", "pack"):
        read_chunks(st, [Want(i, c) for i, c in enumerate(refs)], deliver, stages=times, decoders=workers,
                    order=how, gap=(1 << 20) if how == "pack" else 0)
    else:  # one chunk at a time per thread, as the split fill read before
        size = st.chunk_buffer_size([m])
        with BufferPool(workers, size) as bufs, BufferPool(workers, CHUNK) as outs:
            def one(c: Any) -> None:
                with bufs.borrowed() as b, outs.borrowed() as o:
                    deliver(Want(0, c), st.read_raw(c, b, o.view, cached=True))
            with ThreadPoolExecutor(workers) as ex:
                list(ex.map(one, refs))
    wall = time.perf_counter() - t0
    assert sink[0] == raw, (sink[0], raw)
    return {"how": how, "wall_s": round(wall, 3), "stored_GBps": round(stored / wall / 1e9, 3),
            "raw_GBps": round(raw / wall / 1e9, 3), "stages": times.table()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=8)
    ap.add_argument("--mix", choices=("weights", "serving"), default="weights")
    ap.add_argument("--threads", default=f"1,8,{os.cpu_count() or 2}")
    ap.add_argument("--workers", type=int, default=None, help="pipeline workers (default: the pipeline's)")
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--codecs-only", metavar="IMAGE", help=argparse.SUPPRESS)
    ap.add_argument("--ingest-variants", default="", help="only the ingest, once per variant: wN (N workers), "
                    "siMS (GIL switch interval MS ms), fixed (fixed-size chunks), "
                    "or several joined by +, e.g. w16,w8+si0.5,fixed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    threads = [int(x) for x in a.threads.split(",") if x]
    if a.codecs_only:
        print(json.dumps(codec_rates(a.codecs_only, threads)))
        return
    src_dir = tempfile.mkdtemp(prefix="gpusnap-hostpath-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="gpusnap-hostpath-", dir=a.dir)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
                           "mix": a.mix, "libzstd": zstdlib.version()}
    try:
        image = os.path.join(src_dir, "pages-1.img")
        out["image_gb"] = round(make_image(image, a.gb, a.mix) / 1e9, 3)
        if a.ingest_variants:
            out["variants"] = {}
            for v in a.ingest_variants.split(","):
                workers, chunker, si = a.workers, "pages", sys.getswitchinterval()
                for part in v.split("+"):
                    if part.startswith("w"):
                        workers = int(part[1:])
                    elif part.startswith("si"):
                        sys.setswitchinterval(float(part[2:]) / 1000)
                    elif part == "fixed":
                        chunker = "fixed"
                shutil.rmtree(os.path.join(work, "store"), ignore_errors=True)
                ing, _ = ingest(os.path.join(work, "store"), image, workers, chunker)
                sys.setswitchinterval(si)
                out["variants"][v] = ing
                print(json.dumps({v: ing}), flush=True)
            report_json(out, a.json)
            return
        out["floor"] = disk_floor(work, 2)
        print(json.dumps({"floor": out["floor"]}), flush=True)
        out["codecs_libzstd"] = codec_rates(image, threads)
        print(json.dumps({"codecs_libzstd": out["codecs_libzstd"]}), flush=True)
        child = subprocess.run([sys.executable, "-m", "scripts.bench.bench_hostpath", "--codecs-only", image,
                                "--threads", a.threads], env=child_env(GPUSNAP_NO_LIBZSTD="1"),
                               capture_output=True, text=True, timeout=300)
        out["codecs_python_zstandard"] = json.loads(child.stdout) if child.returncode == 0 else child.stderr[-400:]
        print(json.dumps({"codecs_python_zstandard": out["codecs_python_zstandard"]}), flush=True)
        ing, st = ingest(os.path.join(work, "store"), image, a.workers)
        ing["over_write_floor"] = round(ing["wall_s"] / (ing["stored_gb"] / out["floor"]["write_gbps"]), 2)
        out["ingest"] = ing
        print(json.dumps({"ingest": ing}), flush=True)
        workers = a.workers or pipeline.default_workers()
        out["read"] = []
        for how in ("given", "pack", "one-at-a-time"):
            r = read_back(st, how, workers)
            r["over_read_floor"] = round(r["wall_s"] / (ing["stored_gb"] / out["floor"]["read4_gbps"]), 2)
            out["read"].append(r)
            print(json.dumps({"read": r}), flush=True)
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    report_json(out, a.json)


if __name__ == "__main__":
    main()
