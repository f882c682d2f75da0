#!/usr/bin/env python3
"""Chunk ids over raw bytes (issue 17): puts and reads of this checkout against another gpusnap
checkout (e.g. the commit before raw-addressed chunks) on the same data, rounds interleaved.

Per checkout and round, each on a fresh store: first put; second put after 5% of the bytes changed
(scripts/bench/bench_store.change_5_percent); third put of the same, unchanged data; get; verify;
verify --read-data (where the checkout has it). Every put ends with sync inside the timed region and
the page cache is dropped before every timed command. Prints medians and each put's counters.
Usage (root): python3 -m scripts.bench.bench_rawid [--before DIR] [--gb 1.4] [--rounds 2] [--json F]
       python3 -m scripts.bench.bench_rawid --micro     (per-chunk CPU costs of each step)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from scripts.bench.bench_store import change_5_percent, make_data
from scripts.helpers import REPO, drop_caches


def run(code: str, argv: list[str], cwd: str) -> tuple[float, dict | None]:
    """Seconds for `gpusnap ARGV` from checkout CODE (sync included) and its --json output, if any."""
    env = {**os.environ, "PYTHONPATH": code}
    drop_caches(required=True)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "cli", *argv], env=env, cwd=code, capture_output=True, text=True)
    os.sync()
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{code}: gpusnap {' '.join(argv[2:4])} failed: {p.stderr.strip()[-400:]}")
    try:
        return dt, json.loads(p.stdout)
    except ValueError:
        return dt, None


def has_read_data(code: str) -> bool:
    p = subprocess.run([sys.executable, "-m", "cli", "store", "verify", "--help"], cwd=code,
                       env={**os.environ, "PYTHONPATH": code}, capture_output=True, text=True)
    return "--read-data " in p.stdout


def one_round(label: str, code: str, work: str, gb: float) -> dict[str, float]:
    data, store = os.path.join(work, f"data-{label}"), os.path.join(work, f"store-{label}")
    total = make_data(data, gb)
    g = ["--store", store]
    out: dict[str, float] = {}
    counters = ("new_bytes", "chunks_new", "chunks_dedup", "chunks_compressed")
    for i, what in enumerate(("first", "second", "third")):
        if what == "second":
            change_5_percent(data, total)
        dt, rep = run(code, [*g, "store", "put", f"s{i}", data, "--json"], work)
        out[f"{what}_put_s"] = dt
        for c in counters:
            if rep is not None and c in rep:
                out[f"{what}_{c}"] = rep[c]
        for stage in ("compress", "hash", "read", "write"):  # thread-seconds, summed over workers
            if rep is not None and stage in rep.get("stages", {}):
                out[f"{what}_{stage}_thr"] = rep["stages"][stage]["thread_seconds"]
    out["get_s"], rep = run(code, [*g, "store", "get", "s2", os.path.join(work, f"out-{label}"), "--json"], work)
    for stage, t in (rep or {}).get("stages", {}).items():  # read+verify/decompress, or read/decompress+verify
        out[f"get_{stage}_thr"] = t["thread_seconds"]
    out["verify_s"], _ = run(code, [*g, "store", "verify"], work)
    if has_read_data(code):
        out["verify_read_data_s"], _ = run(code, [*g, "store", "verify", "--read-data"], work)
    same = subprocess.run(["cmp", os.path.join(data, "bf16.bin"), os.path.join(work, f"out-{label}",
                                                                              os.path.basename(data), "bf16.bin")])
    if same.returncode != 0:
        raise SystemExit(f"{label}: the restore was not identical to the data")
    for p in (data, store, os.path.join(work, f"out-{label}")):
        shutil.rmtree(p, ignore_errors=True)
    out["bytes"] = total
    return out


def micro(reps: int = 40) -> dict[str, dict[str, float]]:
    """Per 4 MiB chunk, milliseconds of one thread: the hashes and codec steps a put and a read make
    (bf16-like and random data), so that the per-chunk trade can be read without the disk."""
    import blake3
    import numpy as np
    import zstandard

    from storage.format.chunkfile import RAW_ID_CONTEXT
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.02, 2 << 20).astype(np.float32)
    kinds = {"bf16": (w.view(np.uint32) >> 16).astype(np.uint16).tobytes(), "random": rng.bytes(4 << 20)}
    cctx, dctx = zstandard.ZstdCompressor(level=1, write_content_size=True), zstandard.ZstdDecompressor()
    out: dict[str, dict[str, float]] = {}
    for kind, data in kinds.items():
        comp = cctx.compress(data)
        steps = {
            "hash raw (derived, 1 thread)": lambda: blake3.blake3(data, derive_key_context=RAW_ID_CONTEXT).digest(),
            "hash raw (derived, max_threads AUTO)": lambda: blake3.blake3(
                data, derive_key_context=RAW_ID_CONTEXT, max_threads=blake3.blake3.AUTO).digest(),
            "hash stored (zstd payload)": lambda: blake3.blake3(comp).digest(),
            "zstd-1 compress": lambda: cctx.compress(data),
            "zstd decompress": lambda: dctx.decompress(comp, max_output_size=len(data)),
        }
        out[kind] = {"stored_ratio": round(len(comp) / len(data), 3)}
        for name, fn in steps.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[kind][name] = round((time.perf_counter() - t0) / reps * 1e3, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=None, help="another gpusnap checkout to compare with")
    ap.add_argument("--gb", type=float, default=1.4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", default=None)
    ap.add_argument("--micro", action="store_true", help="only the per-chunk CPU costs (no disk)")
    a = ap.parse_args()
    if a.micro:
        res = {"machine": f"{platform.node()} {os.cpu_count()} cores", "load": os.getloadavg(), "ms_per_4MiB": micro()}
        print(json.dumps(res, indent=1))
        return
    codes = {"after": str(REPO)} if a.before is None else {"before": os.path.abspath(a.before), "after": str(REPO)}
    work = tempfile.mkdtemp(prefix="gpusnap-rawid-", dir=a.dir)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.node()} {os.cpu_count()} cores",
                 "load_before": os.getloadavg(), "codes": codes, "rounds": {k: [] for k in codes}}
    try:
        for r in range(a.rounds):
            for label, code in codes.items() if r % 2 == 0 else reversed(list(codes.items())):
                res["rounds"][label].append(one_round(label, code, work, a.gb))
                print(f"round {r} {label}: " + json.dumps(res["rounds"][label][-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_after"] = os.getloadavg()
    print(f"\n{res['machine']}, {res['rounds']['after'][0]['bytes'] / 1e9:.2f} GB (1/3 zeros, 1/3 random, 1/3 bf16); "
          f"medians of {a.rounds} round(s); load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}")
    keys = [k for k in res["rounds"]["after"][0] if k.endswith("_s")]
    print(f"{'':8} " + " ".join(f"{k.removesuffix('_s'):>18}" for k in keys))
    for label, rounds in res["rounds"].items():
        print(f"{label:8} " + " ".join(f"{statistics.median(r[k] for r in rounds):18.2f}" if k in rounds[0]
                                       else f"{'-':>18}" for k in keys))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
