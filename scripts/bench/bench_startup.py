#!/usr/bin/env python3
"""Start-up benchmark (issue 25 item 9): `gpusnap --help` and `gpusnap store ls` with a cold page cache,
against borg (`borg --help`, `borg list REPO`) and restic (`restic --help`, `restic snapshots`) in the
same run, on stores/repositories holding the same three small snapshots.

Cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before every timed command (root; without root the
figures are warm and the output says so). Each command is timed RUNS times; the median is reported.
Setup (idempotent): borgbackup and restic are installed with apt-get where missing (root, Debian).
Usage: python3 -m scripts.bench.bench_startup [--runs 5] [--no-install] [--json F]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from scripts.helpers import child_env, drop_caches, report_json


def setup(install: bool) -> None:
    """borgbackup and restic, installed with apt where missing (nothing done when both are there)."""
    missing = [pkg for pkg, exe in (("borgbackup", "borg"), ("restic", "restic")) if not shutil.which(exe)]
    if not missing or not install:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print(f"cannot install {missing} (needs root and apt-get); comparing with what is present", file=sys.stderr)
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=False, env=env, stdout=subprocess.DEVNULL)


def timed(argv: list[str], env: dict[str, str], runs: int) -> dict[str, float]:
    times = []
    cold = True
    for _ in range(runs):
        cold = drop_caches() and cold
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        times.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3), "cold": cold}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-install", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    setup(not a.no_install)
    top = tempfile.mkdtemp(prefix="gpusnap-bench-startup-", dir="/var/tmp")
    out: dict[str, object] = {"runs": a.runs}
    try:
        data = os.path.join(top, "data")
        os.makedirs(data)
        for i in range(3):
            with open(os.path.join(data, f"f{i}"), "wb") as f:
                f.write(os.urandom(1 << 20))
        g_env = child_env()
        store = os.path.join(top, "store")
        gs = [sys.executable, "-m", "cli", "--store", store]
        for i in range(3):
            subprocess.run([*gs, "store", "put", f"s{i}", data], check=True, stdout=subprocess.DEVNULL, env=g_env)
        res: dict[str, dict[str, float]] = {
            "gpusnap --help": timed([sys.executable, "-m", "cli", "--help"], g_env, a.runs),
            "gpusnap store ls": timed([*gs, "store", "ls"], g_env, a.runs)}
        if shutil.which("borg"):
            repo = os.path.join(top, "borg")
            b_env = {**os.environ, "BORG_PASSPHRASE": "", "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
                     "BORG_BASE_DIR": os.path.join(top, "borg-home")}
            subprocess.run(["borg", "init", "-e", "none", repo], check=True, env=b_env, stderr=subprocess.DEVNULL)
            for i in range(3):
                subprocess.run(["borg", "create", f"{repo}::s{i}", data], check=True, env=b_env)
            res["borg --help"] = timed(["borg", "--help"], b_env, a.runs)
            res["borg list"] = timed(["borg", "list", repo], b_env, a.runs)
            out["borg_version"] = subprocess.run(["borg", "--version"], capture_output=True, text=True).stdout.strip()
        if shutil.which("restic"):
            repo = os.path.join(top, "restic")
            r_env = {**os.environ, "RESTIC_PASSWORD": "bench", "RESTIC_REPOSITORY": repo,
                     "RESTIC_CACHE_DIR": os.path.join(top, "restic-cache")}
            subprocess.run(["restic", "init", "-q"], check=True, env=r_env, stdout=subprocess.DEVNULL)
            for _ in range(3):
                subprocess.run(["restic", "-q", "backup", data], check=True, env=r_env, stdout=subprocess.DEVNULL)
            res["restic --help"] = timed(["restic", "--help"], r_env, a.runs)
            res["restic snapshots"] = timed(["restic", "snapshots"], r_env, a.runs)
            out["restic_version"] = subprocess.run(["restic", "version"], capture_output=True, text=True).stdout.strip()
        out["results"] = res
        if "borg --help" in res:
            out["vs_borg"] = {"--help": round(res["gpusnap --help"]["median_s"] / res["borg --help"]["median_s"], 2),
                              "ls": round(res["gpusnap store ls"]["median_s"] / res["borg list"]["median_s"], 2)}
    finally:
        shutil.rmtree(top, ignore_errors=True)
    report_json(out, a.json)


if __name__ == "__main__":
    main()
