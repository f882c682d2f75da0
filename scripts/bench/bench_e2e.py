#!/usr/bin/env python3
"""The whole-system benchmark (issues 5, 7, 17): a CUDA process holding N GB, checkpointed and restored

  1. baseline, NVIDIA's own path: driver lock+checkpoint, plain `criu dump` into a directory on disk
     (synced), process gone, caches dropped, `criu restore -d`, driver restore+unlock, memory verified;
     then the floor: the same images restored again from memory (page cache) with THP `always`;
  2. gpusnap host-staged, for each images path asked (`stream`: CRIU's --stream served by gpusnap;
     `staging`: CRIU files on /dev/shm): `gpusnap criu dump` into a store on the same disk, process
     gone, caches dropped, `gpusnap criu restore`, verified by the process itself;
  3. dedup: a second dump of the restored process after it changed 5% of its state, with the first
     snapshot as its parent (`--parent e2e`: changed chunks stored as deltas against it, FORMAT.md
     "Delta entries"; reported against the bytes the workload says it changed), then a warm
     restore of that snapshot (its chunks still in the page cache, its bases too), verified again.

Workloads: `serving` (scripts/workloads/serving_workload.py: a Llama-shaped bf16 model, paged KV pool, CUDA
graph, zero-heavy; checks its own logits and every tensor's checksum), `moe`
(scripts/workloads/moe_workload.py: weights-dominated, few zeros, two CUDA processes in one tree,
pinned host memory, a CUDA graph; each process checks its own memory) or `synthetic`
(scripts/gpu_workload.py). Every CUDA process of the tree goes through the driver's checkpoint and
restore in the baseline as in gpusnap. Both use the same CRIU binary (the one the baseline finds is
exported as GPUSNAP_CRIU for gpusnap's calls). Same disk, same durability (sync inside the timed
region for the baseline; gpusnap fsyncs its chunks), page cache dropped before both cold restores.
The disk's floors are measured in the same run, on the same directory (buffered write + fsync;
cold sequential read with 16 MiB reads, one reader and four). Prints seconds and GB/s per stage, the
ratios to the baseline, and each figure's distance from its floor (dump: the driver's checkpoint +
the bytes written at the disk's write rate; restore: the bytes read at the cold read rate + the
driver's restore).
Usage: bench_e2e.py [--gb 20] [--workload serving|moe] [--paths stream,staging] [--dir /var/tmp] [--json OUT]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from sandbox.criu.runner import Criu
from sandbox.gpu.driver import CudaDriver
from sandbox.gpu.checkpoint import checkpoint_all, restore_all
from sandbox.host.hugepages import thp
from scripts.bench.fill_stalls import idle_disk, stalls
from scripts.bench.timeline import Timeline, phase_line
from scripts.helpers import REPO, child_env, disk_floor, drop_caches, second_dump_pages
from scripts.workloads.workload_control import Workload




OWN_ENV: dict[str, str] = {}  # settings for gpusnap's own commands only (--criu-logs), not the baseline's CRIU
SCRIPTS = {"serving": "serving_workload.py", "moe": "moe_workload.py", "synthetic": "gpu_workload.py"}


def gpusnap(store: str, *args: str, path: str = "stream", extra_env: dict[str, str] | None = None,
            wrap: Sequence[str] = ()) -> dict:
    """`gpusnap --store STORE ARGS --json` in a child (WRAP: a command it runs under, e.g. a profiler's
    `py-spy record ... --`), its JSON report; SystemExit with its stderr when it fails."""
    env = child_env(GPUSNAP_CRIU_IMAGES=path, **OWN_ENV, **(extra_env or {}))
    p = subprocess.run([*wrap, sys.executable, "-m", "cli", "--store", store, *args, "--json"],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"gpusnap {' '.join(args)} failed: {p.stderr.strip()}")
    out = p.stdout if not wrap else "".join(  # a profiler's own lines (py-spy's begin "py-spy> ") are not the report
        ln for ln in p.stdout.splitlines(keepends=True) if not ln.startswith("py-spy> "))
    return json.loads(out)


def driver_restore_s(g: dict, b: dict | None) -> float:
    """The driver's restore in gpusnap's run of the floor (stored bytes at the cold read rate + this):
    its `gpu_restore` seconds, all of it after the fill; with early GPU copies (each process's copy
    started once its memory is in, beside the fill) the longest single copy instead, which is what
    the copies of all processes take side by side without the fill (one core each). The baseline's
    own driver restore where gpusnap reported none."""
    early = (g.get("restore_early_gpu") or {}).get("copy_s") or {}
    if early:
        return max(float(v) for v in early.values())
    return g["restore_stages"].get("gpu_restore", b["driver_restore+unlock"] if b else 0.0)


_RESTORE_PHASES = (("startup", None), ("load", "entered"), ("prepare", "loaded"), ("prepare:gpu", "gpu_side_begin"),
                   ("prepare:rest", "gpu_side_done"), ("plan", "serve_begin"), ("plan:split", "pagemaps_read"),
                   ("plan:fill-start", "planned"), ("plan:serve", "fill_started"),
                   ("criu", "criu_begin"), ("fill", "criu_done"),
                   ("between", "fill_done"), ("gpu", "gpu_begin"), ("exit", "gpu_done"))


def restore_traced(out: dict, key: str, store: str, name: str, path: str, work: str,
                   extra_env: dict[str, str] | None = None) -> dict:
    """`gpusnap criu restore NAME`, timed into OUT[KEY], the machine sampled meanwhile: OUT[KEY +
    "_phases"] says per phase of the restore (its own marks) how busy the cores and the disk were."""
    before = vmstat()
    began = time.time()  # CRIU's log of this restore is written after it
    with Timeline(work) as tl:
        t0 = time.monotonic()
        r = timed(out, key, gpusnap, store, "criu", "restore", name, path=path, extra_env=extra_env)
        t1 = time.monotonic()
    out[key + "_vmstat"] = vmstat_since(before)
    marks = (r.get("stages", {}).get("served") or {}).pop("monotonic", {})
    seq = [(ph, t0 if m is None else marks.get(m)) for ph, m in _RESTORE_PHASES]
    seq = [(ph, t) for ph, t in seq if t is not None] + [("end", t1)]
    out[key + "_phases"] = tl.phases(seq)
    out[key + "_timeline"] = tl.as_json(t0)
    # each CUDA process's host memory complete (its GPU copy started, beside the fill), and the copies' seconds
    early = {k: round(v - t0, 3) for k, v in marks.items() if k.startswith("filled_")}
    if early:
        out[key + "_early_gpu"] = {"filled_at_s": early, "copy_s": r.get("stages", {}).get("gpu_early"),
                                   "gpu_begin_s": round(marks["gpu_begin"] - t0, 3) if "gpu_begin" in marks else None}
        print(f"{key} early GPU copies: {out[key + '_early_gpu']}", flush=True)
    print(f"{key} phases: {phase_line(out[key + '_phases'])}", flush=True)
    active, idle, mean = stalls(out[key + "_timeline"], 1.0)  # BENCHMARKS.md section 41
    really = idle_disk(out[key + "_timeline"], 1.0)
    out[key + "_disk_stalls"] = {"active": active, "read_nothing": idle, "disk_idle": really, "mean_read_gbps": round(mean, 3)}
    print(f"{key} disk: {idle} of {active} active samples read nothing ({really} with the disk idle),"
          f" mean {mean:.2f} GB/s", flush=True)
    out[key + "_waits"] = restore_waits(r, out[key + "_vmstat"], since=began)
    print(f"{key} waits: {json.dumps(out[key + '_waits'])}", flush=True)
    return r


def restore_waits(report: dict, vmstat_delta: dict[str, int], since: float) -> dict:
    """Where a restore's CRIU part waited, in one place: CRIU's own pauses (its log, where
    --criu-logs kept it: the newest restore log written since SINCE), the serve's feed counters, how
    late gpusnap's threads woke (--wake-probe) and the kernel's counters over the restore."""
    from scripts.bench.criu_log_waits import waits
    served = (report.get("stages") or {}).get("served") or {}
    st = served.get("stages") or {}
    got: dict = {k: round(st[k]["thread_seconds"], 3) for k in ("feed:wait", "feed:queued", "feed:write") if k in st}
    if "criu_wake_late" in served:
        got["wake_late"] = served["criu_wake_late"]
    got["vmstat"] = {k: v for k, v in vmstat_delta.items() if v and k != "pgfault"}
    logs = OWN_ENV.get("GPUSNAP_CRIU_LOGS")
    if logs and os.path.isdir(logs):
        mine = sorted((e.stat().st_mtime, e.path) for e in os.scandir(logs)
                      if e.name.startswith("restore-") and e.stat().st_mtime >= since)
        if mine:
            with open(mine[-1][1], errors="replace") as f:
                got["criu_log"] = {"file": os.path.basename(mine[-1][1]), **waits(f, 0.02)}
    return got


VMSTAT_KEYS = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "compact_fail", "allocstall_normal",
               "allocstall_movable", "pgmajfault", "pgfault", "pgscan_kswapd", "pgscan_direct")


def vmstat() -> dict[str, int]:
    """The counters of /proc/vmstat that say whether a restore's page faults waited on the kernel (huge
    pages allocated or refused, direct compaction, direct reclaim); {} where it cannot be read."""
    try:
        with open("/proc/vmstat") as f:
            pairs = (line.split() for line in f)
            return {k: int(v) for k, v in pairs if k in VMSTAT_KEYS}
    except (OSError, ValueError):
        return {}


def vmstat_since(before: dict[str, int]) -> dict[str, int]:
    """vmstat()'s counters now, less BEFORE (an earlier vmstat())."""
    after = vmstat()
    return {n: after[n] - before[n] for n in after if n in before}


def traced(out: dict, key: str, work: str, fn, *a, **k):
    """FN(*A, **K) timed into OUT[KEY], the machine's busy cores and disk rates over it in OUT[KEY + "_phases"],
    the kernel's reclaim, compaction and huge page counters in OUT[KEY + "_vmstat"]."""
    before = vmstat()
    with Timeline(work) as tl:
        t0 = time.monotonic()
        r = timed(out, key, fn, *a, **k)
        t1 = time.monotonic()
    out[key + "_vmstat"] = vmstat_since(before)
    out[key + "_phases"] = {"all": tl.span(t0, t1)}
    out[key + "_timeline"] = tl.as_json(t0)
    print(f"{key} phases: {phase_line(out[key + '_phases'])}", flush=True)
    return r


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(stages: dict, name: str, fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    stages[name] = time.perf_counter() - t0
    return out


def kill_restored(pids: list[int]) -> None:
    """Kill a restored tree's processes (not our children unless we are their subreaper) and wait
    until their pids are free."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    for pid in pids:
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.05)


def verify(w: Workload) -> dict:
    r = w.cmd("verify")
    return {k: v for k, v in r.items() if k != "cmd"}


def baseline(criu: Criu, drv: CudaDriver, a: argparse.Namespace, work: str) -> dict:
    """NVIDIA's own path: driver lock+checkpoint, plain CRIU to disk (+sync), cold restore, driver
    restore; then the floor: the same images restored from the page cache with THP `always`."""
    base: dict = {}
    with Workload(a.gb, mix=a.mix, seed=21, detached=True, script=SCRIPTS[a.workload]) as w:
        base["workload"] = w.info
        images = os.path.join(work, "baseline")
        os.mkdir(images)
        timed(base, "driver_lock+checkpoint", checkpoint_all, drv, w.pids)

        def dump() -> None:
            criu.dump(w.pid, images)
            os.sync()
        traced(base, "criu_dump+sync", work, dump)
        w.reap()
        base["image_bytes"] = du(images)
        drop_caches(required=True)
        traced(base, "criu_restore", work, criu.restore, images, detach=True)
        traced(base, "driver_restore+unlock", work, restore_all, drv, w.pids)
        base["verify"] = verify(w)
        base["verified"] = base["verify"]["ok"]
        base["dump"] = base["driver_lock+checkpoint"] + base["criu_dump+sync"]
        base["restore"] = base["criu_restore"] + base["driver_restore+unlock"]
        base["total"] = base["dump"] + base["restore"]
        if not a.no_warm_floor:
            # the floor of a restore: CRIU from memory (the image is in the page cache now) with huge pages
            kill_restored(w.pids)
            floor: dict = {}
            with thp("always"):
                timed(floor, "criu_restore", criu.restore, images, detach=True)
                timed(floor, "driver_restore+unlock", restore_all, drv, w.pids)
            floor["verified"] = verify(w)["ok"]
            floor["restore"] = floor["criu_restore"] + floor["driver_restore+unlock"]
            base["floor_warm_thp"] = floor
        shutil.rmtree(images)
    return base


def run_gpusnap(a: argparse.Namespace, work: str, path: str, dedup: bool) -> dict:
    g: dict = {"images_path": path}
    store = os.path.join(work, f"store-{path}")
    with Workload(a.gb, mix=a.mix, seed=21, detached=True, script=SCRIPTS[a.workload]) as w:
        d = traced(g, "dump", work, gpusnap, store, "criu", "dump", str(w.pid), "e2e", path=path)
        g["dump_report_path"] = d.get("images_path")
        g["dump_stages"] = d["seconds"]
        g["ingest_stages"] = d.get("stages")
        g["stored_bytes"] = d["new_bytes"]
        g["image_bytes"] = d["raw_bytes"]
        w.reap()
        drop_caches(required=True)
        r = restore_traced(g, "restore", store, "e2e", path, work)
        g["restore_report_path"] = r.get("images_path")
        g["restore_stages"] = r["seconds"]
        g["restore_served"] = r.get("stages", {}).get("served")
        g["verify"] = verify(w)
        g["verified"] = g["verify"]["ok"]
        for variant in a.restore_variants:
            # the same snapshot restored cold again with other settings (GPUSNAP_* variables), same run
            kill_restored(w.pids)
            drop_caches(required=True)
            v: dict = {"env": variant}
            rv = restore_traced(v, "restore", store, "e2e", path, work, extra_env=variant)
            v["restore_stages"] = rv["seconds"]
            v["restore_served"] = rv.get("stages", {}).get("served")
            v["verified"] = verify(w)["ok"]
            g.setdefault("restore_variants", []).append(v)
            print("restore variant", json.dumps(v), flush=True)
        for i, variant in enumerate(a.dump_variants):
            # the restored process dumped again (left running) into a store of its own (nothing to
            # dedup against), once per variant, default settings first: dump settings compared in one run
            envs: list[dict[str, str]] = [{}, variant]
            for env in envs:
                vs = os.path.join(work, f"store-dv-{i}")
                v = {"env": env}
                dv = traced(v, "dump", work, gpusnap, vs, "criu", "dump", "--leave-running", str(w.pid), "dv",
                            path=path, extra_env=env)
                v["dump_stages"], v["ingest_stages"], v["stored_bytes"] = dv["seconds"], dv.get("stages"), dv["new_bytes"]
                shutil.rmtree(vs)
                g.setdefault("dump_variants", []).append(v)
                print("dump variant", json.dumps({k: x for k, x in v.items() if not k.endswith("timeline")}), flush=True)
            g["verified_after_dump_variants"] = verify(w)["ok"]
        if dedup:
            # the restored process changes 5% of its state, then a second dump (left running)
            changed = w.cmd("mutate 5").get("bytes")
            d2 = gpusnap(store, "criu", "dump", "--leave-running", "--parent", "e2e", str(w.pid), "e2e-b", path=path)
            g["dedup"] = {"second_new": d2["new_bytes"], "second_over_first": d2["new_bytes"] / max(1, g["stored_bytes"]),
                          "second_dump_s": d2["seconds"], "parent": d2.get("parent"), "changed_bytes": changed,
                          "second_over_changed": d2["new_bytes"] / changed if changed else None,
                          "delta_stages": {k: v for k, v in (d2.get("stages") or {}).items() if k.startswith("delta")},
                          "second_dump_stages": d2.get("stages")}
            g["verified_after_dedup_dump"] = verify(w)["ok"]
            if a.nowhere:  # what no delta can take from the parent (the workload counts only what it meant to change)
                pages = second_dump_pages(store, "e2e", "e2e-b")
                nowhere = pages["nowhere_bytes"]
                g["dedup"].update(nowhere_bytes=nowhere, second_over_nowhere=d2["new_bytes"] / max(1, nowhere),
                                  second_pages=pages["images"])
            # warm restore: the second snapshot, its chunks still in the page cache
            kill_restored(w.pids)
            r2 = timed(g, "warm_restore", gpusnap, store, "criu", "restore", "e2e-b", path=path)
            g["warm_restore_stages"] = r2["seconds"]
            g["verified_after_warm_restore"] = verify(w)["ok"]
    g["total"] = g["dump"] + g["restore"]
    g["fixed_dump"], g["fixed_restore"] = fixed_dump(g), fixed_restore(g)
    g["store_bytes_on_disk"] = du(store)
    shutil.rmtree(store, ignore_errors=True)
    return g


def fixed_dump(g: dict) -> float:
    """Seconds of a gpusnap dump outside its stages: process start, imports, discovery, cleanup."""
    return g["dump"] - g["dump_stages"].get("gpu_checkpoint", 0.0) - g["dump_stages"].get("dump+ingest", 0.0)


def fixed_restore(g: dict) -> float:
    s = g["restore_stages"]
    return g["restore"] - sum(s.get(k, 0.0) for k in ("materialize", "criu_restore", "split_fill", "gpu_restore"))


def rates(result: dict) -> dict:
    """GB/s per stage and each figure against its floor (the disk's rates measured in this run and
    the driver's own checkpoint/restore seconds): {who: {figure: value}}."""
    disk = result.get("disk_floor")
    b = result.get("baseline")
    out: dict = {}
    if not disk:
        return out
    w, r = disk["write_gbps"] * 1e9, max(disk["read1_gbps"], disk["read4_gbps"]) * 1e9
    if b:
        img = b["image_bytes"]
        dump_floor = b["driver_lock+checkpoint"] + img / w
        restore_floor = img / (disk["read1_gbps"] * 1e9) + b["driver_restore+unlock"]  # one image file: one reader
        out["baseline"] = {"criu_dump_gbps": img / b["criu_dump+sync"] / 1e9, "criu_restore_gbps": img / b["criu_restore"] / 1e9,
                           "dump_floor_s": dump_floor, "dump_over_floor": b["dump"] / dump_floor,
                           "restore_floor_s": restore_floor, "restore_over_floor": b["restore"] / restore_floor}
    for path in result.get("paths", []):
        g = result.get(f"gpusnap_{path}")
        if not g:
            continue
        ds, rs = g["dump_stages"], g["restore_stages"]
        stored, img = g["stored_bytes"], g["image_bytes"]
        drv_ck = ds.get("gpu_checkpoint", b["driver_lock+checkpoint"] if b else 0.0)
        drv_rs = driver_restore_s(g, b)
        dump_floor = drv_ck + stored / w
        restore_floor = stored / r + drv_rs
        f = {"dump_floor_s": dump_floor, "dump_over_floor": g["dump"] / dump_floor,
             "restore_floor_s": restore_floor, "restore_over_floor": g["restore"] / restore_floor,
             "ratio": img / max(1, stored)}
        if ds.get("dump+ingest"):
            f["ingest_gbps"] = img / ds["dump+ingest"] / 1e9
        host = g["restore"] - drv_rs
        if host > 0:
            f["restore_host_gbps"] = img / host / 1e9
            f["restore_read_gbps"] = stored / host / 1e9
        out[f"gpusnap_{path}"] = f
        # every stage's rate over the image's bytes (what each stage moves at, whatever it spends)
        out[f"gpusnap_{path}_stages_gbps"] = {f"{side}:{k}": img / v / 1e9 for side, st in (("dump", ds), ("restore", rs))
                                              for k, v in st.items() if isinstance(v, (int, float)) and v > 0}
    return out


def table(result: dict) -> None:
    b = result.get("baseline")
    print(f"\n== {result['workload']} {result['gb']} GB, {result['date']}, CRIU {result.get('criu')} "
          f"({result.get('criu_path')}) for both ==")
    disk = result.get("disk_floor")
    if disk:
        print(f"disk floor {disk['bytes'] / 1e9:.1f} GB: write+fsync {disk['write_gbps']:.2f} GB/s, cold read "
              f"{disk['read1_gbps']:.2f} GB/s (1 reader) / {disk['read4_gbps']:.2f} GB/s (4 readers)")
    for who, f in result.get("rates", {}).items():
        print(f"{who:15s} " + "  ".join(f"{k} {v:.2f}" for k, v in f.items()))
    if b:
        f = b.get("floor_warm_thp")
        print(f"baseline   dump {b['dump']:6.1f} s (driver {b['driver_lock+checkpoint']:.1f} + criu+sync {b['criu_dump+sync']:.1f})"
              f"  restore {b['restore']:6.1f} s (criu {b['criu_restore']:.1f} + driver {b['driver_restore+unlock']:.1f})"
              f"  cycle {b['total']:.1f} s  image {b['image_bytes'] / 1e9:.1f} GB  verified {b['verified']}")
        if f:
            print(f"floor      restore {f['restore']:6.1f} s (criu from memory, THP always {f['criu_restore']:.1f} + driver "
                  f"{f['driver_restore+unlock']:.1f})  verified {f['verified']}")
    for path in result.get("paths", []):
        g = result.get(f"gpusnap_{path}")
        if not g:
            continue
        ds, rs = g["dump_stages"], g["restore_stages"]
        print(f"gpusnap/{path:7s} dump {g['dump']:6.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in ds.items())}; "
              f"process start, imports, discovery, cleanup {fixed_dump(g):.1f})")
        print(f"{'':15s} restore {g['restore']:6.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in rs.items())}; "
              f"the rest {fixed_restore(g):.1f})  "
              f"verified {g['verified']}  stored {g['stored_bytes'] / 1e9:.2f} GB")
        if "warm_restore" in g:
            print(f"{'':15s} warm restore {g['warm_restore']:.1f} s  verified {g['verified_after_warm_restore']}; "
                  f"dedup: second dump wrote {g['dedup']['second_new'] / 1e9:.2f} GB "
                  f"({100 * g['dedup']['second_over_first']:.1f}% of the first"
                  + (f", {g['dedup']['second_over_changed']:.2f}x the {g['dedup']['changed_bytes'] / 1e9:.2f} GB changed"
                     if g["dedup"].get("second_over_changed") else "")
                  + (f", {g['dedup']['second_over_nowhere']:.2f}x the {g['dedup']['nowhere_bytes'] / 1e9:.2f} GB of pages"
                     " found nowhere in the parent" if "nowhere_bytes" in g["dedup"] else "")
                  + f"; parent {g['dedup'].get('parent')}) in {g['dedup']['second_dump_s']}")
        if b:
            print(f"{'':15s} ratios (gpusnap / baseline): dump {g['dump'] / b['dump']:.2f}  restore {g['restore'] / b['restore']:.2f}"
                  f"  cycle speed-up {b['total'] / g['total']:.2f}x  bytes {g['stored_bytes'] / b['image_bytes']:.2f}"
                  + (f"  restore / warm floor {g['restore'] / b['floor_warm_thp']['restore']:.2f}" if "floor_warm_thp" in b else "")
                  + (f"  warm restore / floor {g['warm_restore'] / b['floor_warm_thp']['restore']:.2f}"
                     if "warm_restore" in g and "floor_warm_thp" in b else ""))
        for v in g.get("dump_variants", []):
            ds = v["dump_stages"]
            print(f"{'':15s} dump (--leave-running, own store) with {','.join(f'{k}={x}' for k, x in v['env'].items()) or 'defaults'}: "
                  f"{v['dump']:.1f} s ({', '.join(f'{k} {x:.1f}' for k, x in ds.items())})")
        for v in g.get("restore_variants", []):
            rs = v["restore_stages"]
            print(f"{'':15s} restore with {','.join(f'{k}={x}' for k, x in v['env'].items())}: {v['restore']:.1f} s "
                  f"({', '.join(f'{k} {x:.1f}' for k, x in rs.items())})  verified {v['verified']}"
                  + (f"  / baseline {v['restore'] / b['restore']:.2f}" if b else ""))


def _variant(text: str) -> dict[str, str]:
    """A --restore-variant or --dump-variant: GPUSNAP_* assignments, comma-separated."""
    out = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        if not sep or not k.startswith("GPUSNAP_"):
            raise argparse.ArgumentTypeError(f"{part!r}: expected GPUSNAP_NAME=VALUE")
        out[k] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=20)
    ap.add_argument("--workload", choices=sorted(SCRIPTS), default="serving")
    ap.add_argument("--mix", default="realistic")
    ap.add_argument("--paths", default="stream,staging")
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--no-dedup", action="store_true", help="skip the second dump and the warm restore")
    ap.add_argument("--nowhere", action="store_true", help="after the second dump, count its pages found in no "
                    "page image of the first (reads both snapshots' page images again: ~1 min at 20 GB)")
    ap.add_argument("--no-warm-floor", action="store_true", help="skip the baseline's restore from the page cache")
    ap.add_argument("--floor-gb", type=float, default=4, help="GB written and read to measure the disk (0: skip)")
    ap.add_argument("--restore-variant", dest="restore_variants", action="append", default=[], type=_variant,
                    metavar="VAR=VALUE[,VAR=VALUE]", help="after gpusnap's cold restore, restore the same snapshot "
                    "cold again with these environment variables (repeatable): settings compared in one run")
    ap.add_argument("--dump-variant", dest="dump_variants", action="append", default=[], type=_variant,
                    metavar="VAR=VALUE[,VAR=VALUE]", help="after the restore (and its variants), dump the restored "
                    "process again with default settings and then with these (each --leave-running, into a store "
                    "of its own; repeatable): dump settings compared in one run, e.g. GPUSNAP_ENCODE_PROCS=0")
    ap.add_argument("--criu-logs", metavar="DIR", help="keep the log of each CRIU run gpusnap makes in DIR "
                    "(GPUSNAP_CRIU_LOGS; the baseline's, of every page, are not kept): where CRIU's time went")
    ap.add_argument("--wake-probe", action="store_true", help="gpusnap's restores report how late their threads "
                    "woke while CRIU ran (GPUSNAP_WAKE_PROBE=1: waits on the interpreter's lock or the scheduler)")
    a = ap.parse_args()
    if a.criu_logs:
        OWN_ENV["GPUSNAP_CRIU_LOGS"] = os.path.abspath(a.criu_logs)
    if a.wake_probe:
        OWN_ENV["GPUSNAP_WAKE_PROBE"] = "1"
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: restored trees come back to us to reap
    criu = Criu()
    drv = CudaDriver()
    work = tempfile.mkdtemp(prefix="gpusnap-e2e-", dir=a.dir)
    paths = [p for p in a.paths.split(",") if p]
    # gpusnap's own CRIU calls run the binary the baseline runs (CRIU 4.2.1 where the project built it)
    os.environ["GPUSNAP_CRIU"] = criu.binary
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gb": a.gb, "workload": a.workload,
                    "criu": criu.version, "criu_path": criu.binary, "paths": paths}
    try:
        if a.floor_gb > 0:
            result["disk_floor"] = disk_floor(work, a.floor_gb)
            print("disk_floor", json.dumps(result["disk_floor"]), flush=True)
        if not a.skip_baseline:
            try:
                result["baseline"] = baseline(criu, drv, a, work)
                print("baseline", json.dumps(result["baseline"]), flush=True)
            except Exception as e:  # noqa: BLE001 - report and still measure gpusnap
                result["baseline_error"] = repr(e)
                print("baseline failed:", repr(e), flush=True)
        for i, path in enumerate(paths):
            try:
                result[f"gpusnap_{path}"] = g = run_gpusnap(a, work, path, dedup=(i == 0 and not a.no_dedup))
                print(f"gpusnap_{path}", json.dumps(g), flush=True)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - report and go on with the next path
                result[f"gpusnap_{path}_error"] = repr(e)
                print(f"gpusnap {path} failed:", repr(e), flush=True)
        result["rates"] = rates(result)
        table(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
