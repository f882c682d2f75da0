#!/usr/bin/env python3
"""Store benchmark (issue 2): `gpusnap store put/get` against `tar -I 'zstd -T0'` and `cp` on the same
disk and the same data, in one run; then the dedup figure for a second put after 5% of the data changed.

Data: a directory of files in three kinds, 1/3 each: zeros, random bytes, bf16 values from N(0, 0.02).
Durability is the same on all sides: every write is followed by sync inside the timed region, and the
page cache is dropped before each timed read. Usage: python3 -m scripts.bench.bench_store [--gb 3] [--dir /var/tmp] [--json F]
[--mix mixed|weights|zero-heavy] [--rounds N]

--rounds N: then N more rounds of cp and gpusnap alone, interleaved (put: cp, gpusnap into a fresh store;
get: cp, gpusnap), each cold and synced; the medians and each round's gpusnap/cp ratio are reported.
On a shared VM one pair's ratio moves by 0.5x from hour to hour (cp's own time by 1.2-2.1 s): the
median of interleaved pairs is the figure to compare with a target.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from scripts.helpers import REPO, child_env, drop_caches




def timed(argv: list[str], **kw) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kw)
    os.sync()
    return time.perf_counter() - t0


MIXES = {"mixed": ("zeros", "random", "bf16"),  # 1/3 each
         "weights": ("bf16", "bf16", "bf16"),  # weights-like: bf16 N(0, 0.02), no zeros
         "zero-heavy": ("zeros", "zeros", "bf16")}  # 2/3 zeros, 1/3 bf16


def make_data(root: str, gb: float, seed: int = 0, mix: str = "mixed") -> int:
    rng = np.random.default_rng(seed)
    os.makedirs(root)
    per = int(gb * 1e9 / 3) // (64 << 20) * (64 << 20)
    block = 64 << 20
    for i, kind in enumerate(MIXES[mix]):
        with open(os.path.join(root, f"{i}-{kind}.bin"), "wb") as f:
            for _ in range(per // block):
                if kind == "zeros":
                    f.write(bytes(block))
                elif kind == "random":
                    f.write(rng.bytes(block))
                else:
                    w = rng.normal(0, 0.02, block // 2).astype(np.float32)
                    f.write((w.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    return 3 * per


def change_5_percent(root: str, total: int, seed: int = 1) -> None:
    """Overwrite 5% of the bytes, as contiguous 16 MiB runs spread over the files."""
    rng = np.random.default_rng(seed)
    run = 16 << 20
    todo = total * 5 // 100
    files = sorted(os.path.join(root, f) for f in os.listdir(root))
    i = 0
    while todo > 0:
        path = files[i % len(files)]
        size = os.path.getsize(path)
        off = (size // 4 + (i // len(files)) * 4 * run) % (size - run)
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(rng.bytes(run))
        todo -= run
        i += 1


def rounds(n: int, work: str, data: str, gpusnap: list[str], env: dict[str, str]) -> dict:
    """N rounds of (cp put, gpusnap put into a fresh store, cp get, gpusnap get), each cold and synced:
    {"put": [(cp s, gpusnap s)], "get": [...], "median": {...}}. The stores' gets are checked by the
    first round's cmp (the same code path); each round's get goes to a fresh directory."""
    out: dict = {"put": [], "get": []}
    for i in range(n):
        store = os.path.join(work, f"store-r{i}")
        drop_caches()
        cp_put = timed(["cp", "-r", data, os.path.join(work, f"cp-r{i}")])
        drop_caches()
        g_put = timed([*gpusnap[:-1], store, "store", "put", "s1", data], env=env, cwd=REPO)
        drop_caches()
        cp_get = timed(["cp", "-r", os.path.join(work, f"cp-r{i}"), os.path.join(work, f"cp2-r{i}")])
        drop_caches()
        g_get = timed([*gpusnap[:-1], store, "store", "get", "s1", os.path.join(work, f"got-r{i}")], env=env, cwd=REPO)
        out["put"].append((cp_put, g_put))
        out["get"].append((cp_get, g_get))
        for d in (store, f"cp-r{i}", f"cp2-r{i}", f"got-r{i}"):
            shutil.rmtree(os.path.join(work, d), ignore_errors=True)

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if len(xs) % 2 else sum(sorted(xs)[len(xs) // 2 - 1:len(xs) // 2 + 1]) / 2
    m = {"cp_put": med([c for c, _ in out["put"]]), "gpusnap_put": med([g for _, g in out["put"]]),
         "cp_get": med([c for c, _ in out["get"]]), "gpusnap_get": med([g for _, g in out["get"]])}
    m["put_ratio"] = med([g / c for c, g in out["put"]])
    m["get_ratio"] = med([g / c for c, g in out["get"]])
    out["median"] = m
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=0, help="interleaved cp/gpusnap rounds after the first (medians)")
    ap.add_argument("--mix", choices=sorted(MIXES), default="mixed",
                    help="mixed: 1/3 zeros, random, bf16; weights: all bf16; zero-heavy: 2/3 zeros, 1/3 bf16")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="gpusnap-bench-", dir=a.dir)
    gpusnap = [sys.executable, "-m", "cli", "--store", os.path.join(work, "store")]
    env = child_env()
    res: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cores",
                 "kernel": platform.release()}
    try:
        data = os.path.join(work, "data")
        total = make_data(data, a.gb, mix=a.mix)
        res["mix"] = a.mix
        res["bytes"] = total
        drop_caches()
        res["cp_put"] = timed(["cp", "-r", data, os.path.join(work, "cp")])
        # tar's baseline needs the zstd program (the GPU hosts have none): without it, cp is the only baseline
        with_tar = shutil.which("zstd") is not None
        if with_tar:
            drop_caches()
            res["tar_put"] = timed(["tar", "-I", "zstd -T0", "-cf", os.path.join(work, "x.tar.zst"), "-C", work, "data"])
            res["tar_bytes"] = os.path.getsize(os.path.join(work, "x.tar.zst"))
        drop_caches()
        t0 = time.perf_counter()
        out = subprocess.run([*gpusnap, "store", "put", "s1", data, "--json"], check=True, capture_output=True,
                             text=True, env=env, cwd=REPO).stdout
        res["gpusnap_put"] = time.perf_counter() - t0
        put = json.loads(out)
        res["gpusnap_bytes"] = put["new_bytes"]
        res["gpusnap_put_stages"] = put["stages"]
        drop_caches()
        res["cp_get"] = timed(["cp", "-r", os.path.join(work, "cp"), os.path.join(work, "cp2")])
        if with_tar:
            drop_caches()
            os.mkdir(os.path.join(work, "untar"))
            res["tar_get"] = timed(["tar", "-I", "zstd -T0", "-xf", os.path.join(work, "x.tar.zst"), "-C", os.path.join(work, "untar")])
        drop_caches()
        t0 = time.perf_counter()
        out = subprocess.run([*gpusnap, "store", "get", "s1", os.path.join(work, "got"), "--json"], check=True,
                             capture_output=True, text=True, env=env, cwd=REPO).stdout
        os.sync()
        res["gpusnap_get"] = time.perf_counter() - t0
        res["gpusnap_get_stages"] = json.loads(out)["stages"]
        res["verified"] = all(subprocess.run(["cmp", os.path.join(data, f), os.path.join(work, "got", "data", f)]).returncode == 0
                              for f in sorted(os.listdir(data)))
        change_5_percent(data, total)
        out = subprocess.run([*gpusnap, "store", "put", "s2", data, "--json"], check=True, capture_output=True,
                             text=True, env=env, cwd=REPO).stdout
        res["second_put_new_bytes"] = json.loads(out)["new_bytes"]
        if a.rounds > 0:
            res["rounds"] = rounds(a.rounds, work, data, gpusnap, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = res["bytes"] / 1e9
    print(f"{res['machine']}, {gb:.2f} GB, data {res['mix']} ({', '.join(MIXES[res['mix']])}; bf16 N(0,0.02)), "
          "sync + cold cache\n")
    baselines = ["cp", "tar"] if "tar_put" in res else ["cp"]
    if baselines == ["cp"]:
        print("(no zstd program here: tar's baseline skipped)\n")
    print(f"{'':10} {'put s':>7} {'put GB/s':>9} {'get s':>7} {'get GB/s':>9} {'stored GB':>10} {'ratio':>6}")
    for k, stored in [(k, res.get(k + "_bytes", res["bytes"])) for k in baselines] + [("gpusnap", res["gpusnap_bytes"])]:
        print(f"{k:10} {res[k + '_put']:7.2f} {gb / res[k + '_put']:9.2f} {res[k + '_get']:7.2f} "
              f"{gb / res[k + '_get']:9.2f} {stored / 1e9:10.2f} {res['bytes'] / stored:6.2f}")
    for k in baselines:
        print(f"gpusnap vs {k}: put {res[k + '_put'] / res['gpusnap_put']:.2f}x, get {res[k + '_get'] / res['gpusnap_get']:.2f}x faster")
    print(f"second put after 5% changed: {res['second_put_new_bytes'] / 1e9:.3f} GB written "
          f"({100 * res['second_put_new_bytes'] / res['gpusnap_bytes']:.1f}% of the first); verified={res['verified']}")
    if "rounds" in res:
        r = res["rounds"]
        print(f"{len(r['put'])} interleaved rounds, medians: put cp {r['median']['cp_put']:.2f} s, gpusnap "
              f"{r['median']['gpusnap_put']:.2f} s = {r['median']['put_ratio']:.2f}x cp; get cp {r['median']['cp_get']:.2f} s, "
              f"gpusnap {r['median']['gpusnap_get']:.2f} s = {r['median']['get_ratio']:.2f}x cp")
        print("  per round, gpusnap/cp: put " + " ".join(f"{g / c:.2f}" for c, g in r["put"])
              + "; get " + " ".join(f"{g / c:.2f}" for c, g in r["get"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
