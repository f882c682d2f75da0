#!/usr/bin/env python3
"""Peer benchmark (issue 16): gpusnap's store against restic and borg on the same snapshot-like data,
the same rounds, in one run: first backup, second backup after 5% of the bytes changed (time and bytes
the repository grew by), restore, and a full verify that reads every stored byte.

Same durability on all sides: each timed write ends with sync inside the timed region; the page cache
is dropped before every timed round. restic always encrypts (it has no unencrypted mode); borg runs
with `--encryption none` and zstd level 3; gpusnap with its defaults (zstd level 1 where it pays).
Usage (root, restic and borg installed: `apt-get install restic borgbackup`):
  python3 -m scripts.bench.bench_peers [--gb 2] [--dir /var/tmp] [--json F]
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

from scripts.bench.bench_store import change_5_percent, make_data
from scripts.helpers import REPO, child_env, drop_caches


def du(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def timed(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> float:
    drop_caches(required=True)
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    os.sync()
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{argv[0]} {argv[1] if len(argv) > 1 else ''} failed: {p.stderr.strip()[-400:]}")
    return dt


def tool_version(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "not installed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    for tool in ("restic", "borg"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install restic borgbackup")
    work = tempfile.mkdtemp(prefix="gpusnap-peers-", dir=a.dir)
    data = os.path.join(work, "data")
    store, rrepo, brepo = (os.path.join(work, x) for x in ("store", "restic", "borg"))
    genv = child_env()
    renv = {**os.environ, "RESTIC_PASSWORD": "bench", "RESTIC_REPOSITORY": rrepo, "RESTIC_CACHE_DIR": os.path.join(work, "rcache")}
    benv = {**os.environ, "BORG_REPO": brepo, "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
            "BORG_RELOCATED_REPO_ACCESS_IS_OK": "yes", "BORG_BASE_DIR": os.path.join(work, "bbase")}
    gpusnap = [sys.executable, "-m", "cli", "--store", store]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cores",
                 "kernel": platform.release(), "restic": tool_version(["restic", "version"]),
                 "borg": tool_version(["borg", "--version"])}
    try:
        total = make_data(data, a.gb)
        res["bytes"] = total
        subprocess.run(["restic", "init"], env=renv, check=True, capture_output=True)
        subprocess.run(["borg", "init", "--encryption", "none"], env=benv, check=True, capture_output=True)
        rounds: dict[str, dict[str, float]] = {"gpusnap": {}, "restic": {}, "borg": {}}
        for i, label in enumerate(("first", "second")):
            if i == 1:
                change_5_percent(data, total)
            before = {k: du(p) for k, p in (("gpusnap", store), ("restic", rrepo), ("borg", brepo))}
            rounds["gpusnap"][f"{label}_backup_s"] = timed([*gpusnap, "store", "put", f"s{i}", data], genv, REPO)
            rounds["restic"][f"{label}_backup_s"] = timed(["restic", "backup", "-q", "data"], renv, work)
            rounds["borg"][f"{label}_backup_s"] = timed(["borg", "create", "--compression", "zstd,3", f"::s{i}", "data"], benv, work)
            for k, p in (("gpusnap", store), ("restic", rrepo), ("borg", brepo)):
                rounds[k][f"{label}_added_bytes"] = du(p) - before[k]
        out = {k: os.path.join(work, "out-" + k) for k in rounds}
        rounds["gpusnap"]["restore_s"] = timed([*gpusnap, "store", "get", "s1", out["gpusnap"]], genv, REPO)
        rounds["restic"]["restore_s"] = timed(["restic", "restore", "latest", "--target", out["restic"]], renv, work)
        os.mkdir(out["borg"])
        rounds["borg"]["restore_s"] = timed(["borg", "extract", "::s1"], benv, out["borg"])
        for k in rounds:
            # every file of the data, byte for byte (the names are bench_store.make_data's)
            same = subprocess.run(["diff", "-rq", data, os.path.join(out[k], "data")])
            rounds[k]["restore_identical"] = float(same.returncode == 0)
        rounds["gpusnap"]["verify_s"] = timed([*gpusnap, "store", "verify"], genv, REPO)
        rounds["restic"]["verify_s"] = timed(["restic", "check", "--read-data"], renv, work)
        rounds["borg"]["verify_s"] = timed(["borg", "check", "--verify-data"], benv, work)
        res["rounds"] = rounds
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = res["bytes"] / 1e9
    print(f"{res['machine']}, {gb:.2f} GB (1/3 zeros, 1/3 random, 1/3 bf16 N(0,0.02)); sync timed, cold cache\n"
          f"{res['restic']}; {res['borg']}\n")
    cols = ("first_backup_s", "first_added_bytes", "second_backup_s", "second_added_bytes", "restore_s", "verify_s")
    print(f"{'':8} {'1st s':>7} {'1st GB':>7} {'2nd s':>7} {'2nd GB':>7} {'restore s':>9} {'verify s':>9}")
    for k, r in res["rounds"].items():
        print(f"{k:8} " + " ".join(f"{r[c] / 1e9:7.3f}" if "bytes" in c else f"{r[c]:{9 if c in ('restore_s', 'verify_s') else 7}.2f}" for c in cols))
    g = res["rounds"]["gpusnap"]
    for peer in ("restic", "borg"):
        p = res["rounds"][peer]
        print(f"gpusnap vs {peer}: " + ", ".join(f"{c.removesuffix('_s')} {p[c] / g[c]:.2f}x faster"
                                                for c in cols if c.endswith("_s")))
    if not all(r["restore_identical"] for r in res["rounds"].values()):
        raise SystemExit("a restore was not identical to the data")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
