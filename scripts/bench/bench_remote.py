#!/usr/bin/env python3
"""Benchmark the remote tier against `rclone copy` on the same S3 endpoint and the same data, same run.

Phases: push of a first snapshot, pull into an empty store, then a second snapshot after 5% of the
data changed (push, and pull into the store that has the first). rclone copies the same directory to
and from the same bucket. Optionally (--clients) S3 client throughput (boto3 vs obstore) on many
parallel objects, and (--criu) time to a restored process from the object store vs the local store:
`criu restore --from` into an empty store (the pull overlapping the restore) against the same
snapshot pulled first and then restored (what `--from` did before), and the local store, --runs times
each, interleaved.

    scripts/setup/swift-setup.sh start        # a one-node Swift with s3api on 127.0.0.1:18480
    apt-get install rclone              # Debian's
    .venv/bin/python -m scripts.bench.bench_remote --mb 512 [--clients] [--criu MB [--runs N]] [--criu-only]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
ACCESS, SECRET = "test:tester", "testing"
CREDS = {"GPUSNAP_S3_ACCESS_KEY_ID": ACCESS, "GPUSNAP_S3_SECRET_ACCESS_KEY": SECRET}


def gpusnap(store: Path, *args: str, as_json: bool = True) -> dict:
    env = {**os.environ, **CREDS, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "cli", "--store", str(store), *args,
                        *(["--json"] if as_json else [])], capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"gpusnap {' '.join(args)}: {p.stderr.strip()}")
    return json.loads(p.stdout) if as_json else {}


def rclone(endpoint: str, *args: str) -> tuple[float, int]:
    """Seconds and bytes transferred of one rclone command (its JSON stats)."""
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}  # rclone 1.60 fails on it over http
    env = {**env, "RCLONE_CONFIG_SW_TYPE": "s3", "RCLONE_CONFIG_SW_PROVIDER": "Other",
           "RCLONE_CONFIG_SW_ENDPOINT": endpoint, "RCLONE_CONFIG_SW_ACCESS_KEY_ID": ACCESS,
           "RCLONE_CONFIG_SW_SECRET_ACCESS_KEY": SECRET, "RCLONE_CONFIG_SW_REGION": "us-east-1",
           "RCLONE_CONFIG_SW_FORCE_PATH_STYLE": "true"}
    t0 = time.perf_counter()
    p = subprocess.run(["rclone", *args, "--transfers", "8", "--use-json-log", "--stats", "100h",
                        "--stats-log-level", "NOTICE", "--config", "/dev/null"],
                       capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"rclone {' '.join(args)}: {p.stderr[-500:]}")
    sent = 0
    for line in p.stderr.splitlines():
        try:
            stats = json.loads(line).get("stats")
        except ValueError:
            continue
        if stats:
            sent = int(stats.get("bytes", 0))
    return dt, sent


def write_data(d: Path, mb: int) -> None:
    d.mkdir(parents=True)
    rng = np.random.default_rng(7)
    (d / "big.bin").write_bytes(rng.integers(0, 256, mb << 20, dtype=np.uint8).tobytes())
    for i in range(8):
        (d / f"small-{i}.txt").write_text(f"config {i}\n" * 500)


def change_5_percent(d: Path, mb: int) -> None:
    """Rewrite 5% of big.bin, in 4 MiB-aligned pieces spread over the file."""
    f = d / "big.bin"
    data = bytearray(f.read_bytes())
    pieces = max(1, round(mb * 0.05 / 4))
    rng = np.random.default_rng(11)
    for i in range(pieces):
        off = (i * (mb // pieces) // 4 * 4) << 20
        data[off:off + (4 << 20)] = rng.integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    f.write_bytes(bytes(data))


def clients(endpoint: str, sizes_mb: list[int], count: int, jobs: int, bucket: str) -> list[tuple[str, int, float, float]]:
    """(client, object MiB, PUT MiB/s, GET MiB/s) for COUNT objects, JOBS in parallel, in BUCKET/clients/."""
    import boto3
    from botocore.config import Config
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS,
                      aws_secret_access_key=SECRET,
                      config=Config(s3={"addressing_style": "path"}, max_pool_connections=2 * jobs,
                                    request_checksum_calculation="when_required",
                                    response_checksum_validation="when_required"))
    rows = []
    try:
        import obstore
        from obstore.store import S3Store
        ost = S3Store(bucket, endpoint=endpoint, access_key_id=ACCESS, secret_access_key=SECRET,
                      region="us-east-1", virtual_hosted_style_request=False, client_options={"allow_http": True})
    except ImportError:
        obstore = None  # type: ignore[assignment]
    for mb in sizes_mb:
        data = os.urandom(mb << 20)
        impls = [("boto3", lambda k: s3.put_object(Bucket=bucket, Key=k, Body=data),
                  lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read())]
        if obstore is not None:
            impls.append(("obstore", lambda k: obstore.put(ost, k, data), lambda k: obstore.get(ost, k).bytes()))
        for name, put, get in impls:
            keys = [f"clients/{name}/{mb}/{i}" for i in range(count)]
            with ThreadPoolExecutor(jobs) as ex:
                t0 = time.perf_counter()
                list(ex.map(put, keys))
                tp = time.perf_counter() - t0
                t0 = time.perf_counter()
                list(ex.map(get, keys))
                tg = time.perf_counter() - t0
            rows.append((name, mb, count * mb / tp, count * mb / tg))
    return rows


def criu_restore_times(a: Path, b: Path, url: str, endpoint: str, mb: int, runs: int) -> dict[str, list[float]]:
    """Seconds to a restored tree (the command's end: the tree runs), RUNS times each, interleaved:
    `local` from store A; `pull+restore` = `pull` then `criu restore` into a fresh store B; `overlapped` =
    `criu restore --from` into a fresh store B; and, of the overlapped runs, when CRIU connected, when
    the last chunk was local and when the tree ran (before the local commit), from the start of the
    pull inside that command (gpusnap's own report; the command's start-up comes before it)."""
    from scripts.bench.bench_criu import Tree
    out: dict[str, list[float]] = {k: [] for k in ("local", "pull+restore", "pull of it", "overlapped",
                                                   "overlapped: criu started", "overlapped: all local",
                                                   "overlapped: tree running")}

    def fresh_b() -> None:
        shutil.rmtree(b, ignore_errors=True)
        gpusnap(b, "remote", "add", "r", url, "--endpoint", endpoint)

    tree = Tree(mb=mb)
    try:
        gpusnap(a, "criu", "dump", str(tree.pid), "proc")
        tree.gone()
        gpusnap(a, "push", "proc")
        for i in range(runs + 1):  # the first round warms the caches and is not counted
            for kind in ("overlapped", "pull+restore", "local"):
                if kind != "local":
                    fresh_b()
                t0 = time.perf_counter()
                if kind == "local":
                    gpusnap(a, "criu", "restore", "proc")
                elif kind == "pull+restore":
                    gpusnap(b, "pull", "proc")
                    pulled = time.perf_counter() - t0
                    gpusnap(b, "criu", "restore", "proc")
                else:
                    r = gpusnap(b, "criu", "restore", "proc", "--from", "r")
                dt = time.perf_counter() - t0
                if not tree.ok():
                    raise SystemExit(f"{kind}: the restored tree is not healthy")
                tree.kill()
                if i == 0:
                    continue
                out[kind].append(dt)
                if kind == "pull+restore":
                    out["pull of it"].append(pulled)
                if kind == "overlapped":
                    out["overlapped: criu started"].append(r["seconds"]["criu_started"])
                    out["overlapped: all local"].append(r["seconds"]["all_local"])
                    out["overlapped: tree running"].append(r["seconds"]["tree_running"])
                print(f"run {i} {kind}: {dt:.2f} s", flush=True)
        return out
    finally:
        tree.kill()


def count_objects(endpoint: str, bucket: str, prefix: str) -> tuple[int, int]:
    """(objects, bytes) under BUCKET/PREFIX: what a push left on the remote."""
    import boto3
    from botocore.config import Config
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS,
                      aws_secret_access_key=SECRET,
                      config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required"))
    n = size = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            n += 1
            size += o["Size"]
    return n, size


def drop_bucket(endpoint: str, bucket: str) -> None:
    """Delete the benchmark's bucket and everything in it (Swift keeps its data on this machine's disk)."""
    import boto3
    from botocore.config import Config
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS,
                      aws_secret_access_key=SECRET,
                      config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required"))
    try:
        keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                for o in page.get("Contents", [])]
    except s3.exceptions.NoSuchBucket:
        return
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda k: s3.delete_object(Bucket=bucket, Key=k), keys))
    s3.delete_bucket(Bucket=bucket)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="Size of the data set (one big file + small ones).")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--clients", action="store_true", help="Also compare S3 clients on parallel objects.")
    ap.add_argument("--criu", type=int, default=0, metavar="MB",
                    help="Also time `criu restore` of an MB-sized process tree from the local store vs --from the remote.")
    ap.add_argument("--runs", type=int, default=3, help="With --criu: rounds of each restore (after one warm-up).")
    ap.add_argument("--criu-only", action="store_true", help="With --criu: skip the push/pull vs rclone phases.")
    args = ap.parse_args()
    endpoint = subprocess.run([str(REPO / "scripts" / "setup" / "swift-setup.sh"), "start"], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1]
    if not shutil.which("rclone") and not args.criu_only:
        raise SystemExit("rclone is not installed (apt-get install rclone)")
    work = Path(tempfile.mkdtemp(prefix="gpusnap-bench-remote-"))
    bucket = f"gpusnap-bench-{uuid.uuid4().hex[:8]}"
    try:
        data = work / "data"
        write_data(data, args.mb)
        a, b = work / "A", work / "B"
        for s in (a, b):
            gpusnap(s, "remote", "add", "r", f"s3://{bucket}/gpusnap", "--endpoint", endpoint)
        rows = []
        objects: list[tuple[str, int, int]] = []
        j = ["--jobs", str(args.jobs)]
        for phase, snap in () if args.criu_only else (("first", "v1"), ("second (5% changed)", "v2")):
            if snap == "v2":
                change_5_percent(data, args.mb)
            gpusnap(a, "store", "put", snap, str(data))
            size = sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
            before = count_objects(endpoint, bucket, "gpusnap/")[0]
            push = gpusnap(a, "push", snap, *j)
            objects.append((phase, count_objects(endpoint, bucket, "gpusnap/")[0] - before, size))
            pull = gpusnap(b, "pull", snap, *j)
            rt_push, rb_push = rclone(endpoint, "copy", str(data), f"sw:{bucket}/rclone")
            out = work / f"rclone-out-{snap}"
            if snap == "v2":
                shutil.copytree(work / "rclone-out-v1", out)  # rclone's pull side has the first copy
            rt_pull, rb_pull = rclone(endpoint, "copy", f"sw:{bucket}/rclone", str(out))
            rows.append((phase, size, push["seconds"], push["bytes_sent"], pull["seconds"], pull["bytes_sent"],
                         rt_push, rb_push, rt_pull, rb_pull))
        mib = 1 << 20
        print(f"\nremote tier vs rclone copy, {args.mb} MiB data set, {args.jobs} requests in parallel, {endpoint}\n")
        print("| snapshot | tool | push s | push MiB/s | push MiB sent | pull s | pull MiB/s | pull MiB fetched |")
        print("|---|---|---|---|---|---|---|---|")
        for phase, size, gps, gpb, gls, glb, rps, rpb, rls, rlb in rows:
            print(f"| {phase} | gpusnap | {gps:.2f} | {size / mib / gps:.0f} | {gpb / mib:.1f} | {gls:.2f} | "
                  f"{size / mib / gls:.0f} | {glb / mib:.1f} |")
            print(f"| {phase} | rclone copy | {rps:.2f} | {size / mib / rps:.0f} | {rpb / mib:.1f} | {rls:.2f} | "
                  f"{size / mib / rls:.0f} | {rlb / mib:.1f} |")
            print(f"| {phase} | ratio gpusnap/rclone (time) | {gps / rps:.2f} | | {gpb / max(rpb, 1):.2f} (bytes) | "
                  f"{gls / rls:.2f} | | {glb / max(rlb, 1):.2f} (bytes) |")
        print("\n| snapshot | objects the push wrote | objects per GiB of data |\n|---|---|---|")
        for phase, n, size in objects:
            print(f"| {phase} | {n} | {n / (size / (1 << 30)):.0f} |")
        if args.criu:
            import statistics
            t = criu_restore_times(a, b, f"s3://{bucket}/gpusnap", endpoint, args.criu, args.runs)
            print(f"\n| restore of a {args.criu} MiB process tree ({args.runs} runs) | median s | runs |\n|---|---|---|")
            for k, v in t.items():
                print(f"| {k} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
            print(f"| ratio overlapped / pull+restore | "
                  f"{statistics.median(t['overlapped']) / statistics.median(t['pull+restore']):.2f} | |")
        if args.clients:
            print("\n| client | object MiB | PUT MiB/s | GET MiB/s |\n|---|---|---|---|")
            for name, mb, put, get in clients(endpoint, [4, 16, 64], 16, args.jobs, bucket):
                print(f"| {name} | {mb} | {put:.0f} | {get:.0f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        drop_bucket(endpoint, bucket)


if __name__ == "__main__":
    main()
