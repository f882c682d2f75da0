#!/usr/bin/env python3
"""CRIU through the store vs plain CRIU to a directory, same process, same disk, same run (issue 5).

A CPU process tree (scripts/workloads/criu_workload.py: a parent and a forked child) holding N MiB of known
memory (--data random: incompressible; weights: bf16 N(0, 0.02), few zeros; mixed: spread over
thousands of mappings, as a server's heap is, of weights, random bytes, zeros and sparse pools): plain `criu dump` into a
directory + sync, caches dropped, `criu restore`; then `gpusnap criu dump` / `gpusnap criu restore`
(store on the same disk). Both restores are checked from inside the restored process.
Usage: python3 -m scripts.bench.bench_criu [--mb 1024] [--data random|weights|mixed] [--rounds N] [--variant K=V]
       [--dir /var/tmp] [--json F]
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

from sandbox.criu.runner import Criu
from scripts.helpers import REPO, child_env, drop_caches
from scripts.workloads.criu_tree import CriuTree




def Tree(mb: int, data: str, sharing: str) -> CriuTree:
    return CriuTree(mb, data=data, sharing=sharing, prefix="gpusnap-bench-tree-", start_timeout=600)


T0 = time.perf_counter()


def progress(what: str) -> None:
    """One line on stderr per step, with the seconds since the start: a run cut short still says where it was."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {what}", file=sys.stderr, flush=True)


def gpusnap(store: str, *args: str, env: dict[str, str] | None = None) -> dict:
    p = subprocess.run([sys.executable, "-m", "cli", "--store", store, *args, "--json"], capture_output=True,
                       text=True, cwd=REPO, env=child_env(**(env or {})))
    if p.returncode:
        raise SystemExit(p.stderr)
    return json.loads(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--data", choices=("random", "weights", "mixed"), default="random",
                    help="random: incompressible; weights: bf16, few zeros; mixed: thousands of mappings of "
                         "weights, random bytes, zeros and sparse pools")
    ap.add_argument("--sharing", choices=("private", "cow", "own"), default="private",
                    help="the child's memory: its own bytes at the parent's addresses, the parent's shared "
                         "copy-on-write (forked workers), or (with --data mixed) its own at other addresses (a spawned worker)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="cold restores of each, interleaved (the order alternates each round); medians reported")
    ap.add_argument("--variant", action="append", default=[], metavar="K=V[,K=V]",
                    help="also restore gpusnap's snapshot with these environment settings, in every round")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    criu = Criu()
    work = tempfile.mkdtemp(prefix="gpusnap-bench-criu-", dir=a.dir)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cores", "mb": a.mb,
                 "data": a.data, "sharing": a.sharing, "rounds": a.rounds}
    variants = {"gpusnap": {}, **{f"gpusnap {v}": dict(kv.split("=", 1) for kv in v.split(",")) for v in a.variant}}
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in variants}}
    ok: dict[str, bool] = {}
    trees: list[CriuTree] = []
    try:
        progress(f"starting the first tree ({a.mb} MiB, {a.data}, {a.sharing})")
        tp = t = Tree(a.mb, a.data, a.sharing)  # the same data in both trees (same seed), other pids
        trees.append(t)
        progress("plain criu dump")
        assert t.ok(), "the tree did not check out before its dump"  # and its child has written its own bytes
        img = os.path.join(work, "img")
        os.mkdir(img)
        t0 = time.perf_counter()
        criu.dump(t.pid, img)
        os.sync()
        res["plain_dump"] = time.perf_counter() - t0
        res["plain_bytes"] = sum(os.path.getsize(os.path.join(img, f)) for f in os.listdir(img))
        t.gone()
        progress("starting the second tree")
        tg = t = Tree(a.mb, a.data, a.sharing)
        trees.append(t)
        assert t.ok(), "the tree did not check out before its dump"
        progress("gpusnap criu dump")
        store = os.path.join(work, "store")
        t0 = time.perf_counter()
        d = gpusnap(store, "criu", "dump", str(t.pid), "b")
        res["gpusnap_dump"] = time.perf_counter() - t0
        res["gpusnap_dump_stages"] = d["seconds"]
        res["gpusnap_bytes"] = d["new_bytes"]
        t.gone()
        stages: dict[str, list[dict]] = {k: [] for k in variants}
        served: dict[str, list[dict]] = {}  # each restore's stage counters of its serve side (feed waits, reads)
        for rnd in range(a.rounds):
            order = ["plain", *variants] if rnd % 2 == 0 else [*variants, "plain"]
            for who in order:
                t = tp if who == "plain" else tg
                drop_caches(required=True)
                progress(f"round {rnd + 1}: {who} restore")
                t0 = time.perf_counter()
                if who == "plain":
                    criu.restore(img, detach=True)
                else:
                    r = gpusnap(store, "criu", "restore", "b", env=variants[who])
                    stages[who].append(r["seconds"])
                    srv = (r.get("stages") or {}).get("served", {})
                    served.setdefault(who, []).append({**srv.get("stages", {}), **(
                        {"criu_wake_late": srv["criu_wake_late"]} if "criu_wake_late" in srv else {})})
                times[who].append(time.perf_counter() - t0)
                ok[who] = t.ok() and ok.get(who, True)
                t.kill()
                t.gone()  # the pids free again: the next restore takes the same ones
        res["plain_restore"] = statistics.median(times["plain"])
        res["plain_ok"] = ok["plain"]
        res["gpusnap_restore"] = statistics.median(times["gpusnap"])
        res["gpusnap_restore_stages"] = stages["gpusnap"][-1]
        res["gpusnap_ok"] = ok["gpusnap"]
        res["restores"] = times
        res["served_stages"] = served
        res["verified"] = ok
    finally:
        for t in trees:  # whatever of them runs (a failed round leaves its tree restored)
            t.close()
        shutil.rmtree(work, ignore_errors=True)
    what = {"random": "random memory (worst case for compression)", "weights": "bf16 weights (few zeros)",
            "mixed": "mixed data in thousands of mappings"}[a.data]
    print(f"{res['machine']}: process tree (2 processes) with {a.mb} MiB of {what}, the child's "
          f"{ {'private': 'its own', 'cow': 'shared copy-on-write', 'own': 'its own at other addresses'}[a.sharing] }; "
          f"{a.rounds} round(s), medians")
    print(f"plain criu   dump {res['plain_dump']:6.2f} s  restore {res['plain_restore']:6.2f} s  "
          f"{res['plain_bytes'] / 1e9:.2f} GB on disk  verified={res['plain_ok']}")
    print(f"gpusnap criu dump {res['gpusnap_dump']:6.2f} s  restore {res['gpusnap_restore']:6.2f} s  "
          f"{res['gpusnap_bytes'] / 1e9:.2f} GB on disk  verified={res['gpusnap_ok']}")
    print(f"  dump stages {res['gpusnap_dump_stages']}, restore stages {res['gpusnap_restore_stages']}")
    for who in variants:
        if who != "gpusnap":
            print(f"{who}: restore {statistics.median(times[who]):6.2f} s  verified={ok[who]}  "
                  f"/ plain {statistics.median(times[who]) / res['plain_restore']:.2f}")
    print(f"all restores (s): { {k: [round(x, 2) for x in v] for k, v in times.items()} }")
    print(f"ratios gpusnap/plain: dump {res['gpusnap_dump'] / res['plain_dump']:.2f}  "
          f"restore {res['gpusnap_restore'] / res['plain_restore']:.2f}  bytes {res['gpusnap_bytes'] / res['plain_bytes']:.2f}")
    print(f"cycle ratio plain/gpusnap: {(res['plain_dump'] + res['plain_restore']) / (res['gpusnap_dump'] + res['gpusnap_restore']):.2f}x")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
