#!/usr/bin/env python3
"""Issue 56's benchmark: a transformers server (scripts/workloads/transformers_server.py: a Llama-shaped
bf16 model loaded from safetensors, served over HTTP by aiohttp, a paged KV pool, a prefix-cache
session), brought back by each path, in ONE run on the same server. Time is always "start" -> the
first correct HTTP answer (POST /generate returning the tokens the cold start returned):

  cold        process start (page cache dropped) -> first answer
  baseline    the CUDA driver's checkpoint API + plain CRIU dump to disk (synced); page cache dropped;
              `criu restore -d` + the driver's restore -> first answer (scripts/bench/bench_e2e.py's
              baseline, same CRIU binary as gpusnap's)
  nvme        `gpusnap criu dump` into a store on the same disk; page cache dropped; `criu restore`
  hooks       the same with the workload's hooks (--prepare/--resume on the server's /prepare and
              /resume: the KV pool dropped, the caching allocator emptied; emulated by this script
              around the commands where this gpusnap has no --prepare: the JSON says which)
  warm        `store warm` of the nvme snapshot and of the hooks snapshot; page cache dropped; restores
              from the warm tier
  inplace     `gpu checkpoint` + `gpu restore` of the running server (no CRIU) -> first answer
  second      `criu dump --leave-running --parent` after 5% of the KV pool changed: time and bytes
              written against the first dump (--leave-running too) and against the changed bytes

Each restore's stages come from gpusnap's --json report; its floor is the snapshot's stored bytes at the
disk's cold read rate (measured in the same run) + the driver's restore (the baseline's). Bit-exactness
is checked by the server itself (GET /digest: weights, KV pool, prefix cache). Every step is bounded
(--step-timeout), every process this script started is killed at the end, and the JSON (--out) is
rewritten after every step, so a run cut short still leaves what it measured.

Usage: bench_server.py [--gb 16 --kv-gb 12] [--quick] [--dir /var/tmp] [--out server.json]
       [--steps cold,baseline,nvme,second,warm,hooks,inplace] [--device cpu]  (cpu: no driver steps)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from typing import Any, Callable

from scripts.helpers import REPO, child_env, disk_floor, drop_caches

SERVER = os.path.join(REPO, "scripts", "workloads", "transformers_server.py")
DROP = {"nvme": ("nvme",), "second": ("first", "second"), "warm": ("warmsnap",), "hooks": ("hooked",),
        "inplace": ("inplace",)}
STEPS = ["cold", "baseline", "nvme", "second", "warm", "hooks", "inplace"]


class StepError(Exception):
    pass


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = tempfile.mkdtemp(prefix="bench-server-", dir=a.dir)
        self.store = os.path.join(self.work, "store")
        self.warm_dir = os.path.join(self.work, "warm")  # this run's own warm tier (unmounted at the end)
        self.result: dict[str, Any] = {"args": vars(a), "steps": {}, "errors": {}, "started": time.time()}
        self.pids: set[int] = set()        # every server pid ever seen (killed at the end)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.port = 0
        self.hook_port = 0  # the server's /prepare and /resume (criu_hooks.workload_helper's own port where used)
        self.pid = 0
        self.tokens: list[int] | None = None
        self.digest: dict[str, Any] | None = None
        self.env = child_env(GPUSNAP_WARM_DIR=self.warm_dir, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"),
                             HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        from sandbox.criu.runner import Criu
        self.criu = Criu()
        self.env["GPUSNAP_CRIU"] = self.criu.binary  # the baseline's CRIU is gpusnap's too
        self.has_hooks = "--prepare" in subprocess.run(
            [sys.executable, "-m", "cli", "criu", "dump", "--help"], capture_output=True, text=True,
            env=self.env, timeout=60).stdout

    # ---------------------------------------------------------------- plumbing
    def save(self) -> None:
        if self.a.out:
            tmp = self.a.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.result, f, indent=1, default=str)
            os.replace(tmp, self.a.out)

    def http(self, method: str, path: str, timeout: float = 30.0) -> Any:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=b"{}" if method == "POST" else None,
                                     headers={"Connection": "close", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def first_answer(self, t0: float, deadline_s: float | None = None) -> float:
        """Seconds from T0 until POST /generate answers the cold start's tokens (StepError otherwise)."""
        deadline = time.monotonic() + (deadline_s or self.a.step_timeout)
        last = ""
        while time.monotonic() < deadline:
            try:
                got = self.http("POST", "/generate", timeout=max(1.0, deadline - time.monotonic()))["tokens"]
                t = time.perf_counter() - t0
                if self.tokens is not None and got != self.tokens:
                    raise StepError(f"wrong answer {got[:8]}… (cold start: {self.tokens[:8]}…)")
                return t
            except (urllib.error.URLError, ConnectionError, OSError, json.JSONDecodeError) as e:
                last = str(e)
                time.sleep(0.01)
        raise StepError(f"no answer in {deadline_s or self.a.step_timeout:.0f} s ({last})")

    def gpusnap(self, *args: str, timeout: float | None = None) -> dict[str, Any]:
        p = subprocess.run([sys.executable, "-m", "cli", "--store", self.store, *args, "--json"], capture_output=True,
                           text=True, env=self.env, timeout=timeout or self.a.step_timeout)
        if p.returncode != 0:
            raise StepError(f"gpusnap {' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-600:]}")
        out: dict[str, Any] = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {"list": json.loads(p.stdout)}
        return out

    def check_digest(self, kv_kept: bool = True) -> dict[str, Any]:
        d = self.http("GET", "/digest", timeout=self.a.step_timeout)
        ref = self.digest or {}
        same = {k: d.get(k) == ref.get(k) for k in ("weights", "prefix", "kv")}
        ok = same["weights"] and same["prefix"] and (same["kv"] if kv_kept else bool(d.get("kv_zero")))
        return {"ok": ok, **same, "kv_zero": d.get("kv_zero")}

    def kill_server(self) -> None:
        for pid in [self.pid] if self.pid else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 30
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass

    def gone(self) -> None:
        """Wait until the server's pid is free (a dump without --leave-running ends it)."""
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
            for p in self.procs:
                if p.pid == self.pid:
                    try:
                        p.wait(timeout=0.1)
                    except subprocess.TimeoutExpired:
                        pass
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    if f.read().split(") ")[1].startswith("Z"):
                        try:
                            os.waitpid(self.pid, os.WNOHANG)
                        except ChildProcessError:
                            pass
            except OSError:
                pass
            time.sleep(0.05)

    def server_argv(self, ready: str) -> list[str]:
        return [sys.executable, SERVER, "--device", self.a.device, "--gb", str(self.a.gb), "--kv-gb", str(self.a.kv_gb),
                "--cache-dir", self.a.cache_dir, "--ready-file", ready, "--helper"]

    # ---------------------------------------------------------------- steps
    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if name not in self.a.steps:
            return
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            r = fn()
            r["step_s"] = time.perf_counter() - t0
            self.result["steps"][name] = r
            print(json.dumps({k: v for k, v in r.items() if k in ("answer_s", "ok", "digest", "dump_s", "restore_s",
                                                                    "bytes")}, default=str), flush=True)
        except BaseException as e:  # noqa: BLE001 - a step's failure is recorded; the run goes on
            self.result["errors"][name] = f"{type(e).__name__}: {e}"
            self.result["errors"][name + ":trace"] = traceback.format_exc()[-3000:]
            print(f"!! {name}: {type(e).__name__}: {e}", flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        finally:
            self.save()

    def prepare_model(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, SERVER, "--device", self.a.device, "--gb", str(self.a.gb),
                            "--cache-dir", self.a.cache_dir, "--save-only"], capture_output=True, text=True,
                           env=self.env, timeout=self.a.step_timeout * 3)
        if p.returncode != 0:
            raise StepError(f"saving the model failed: {p.stderr[-800:]}")
        path = p.stdout.strip().splitlines()[-1]
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        return {"path": path, "safetensors_bytes": size, "seconds": time.perf_counter() - t0}

    def cold(self) -> dict[str, Any]:
        ready = os.path.join(self.work, "ready")
        drop_caches(required=os.geteuid() == 0)
        log = open(os.path.join(self.work, "server.log"), "ab")
        t0 = time.perf_counter()
        p = subprocess.Popen(self.server_argv(ready), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=self.env, cwd=REPO)
        self.procs.append(p)
        self.pid = p.pid
        self.pids.add(p.pid)
        deadline = time.monotonic() + self.a.step_timeout
        while not os.path.exists(ready):
            if p.poll() is not None:
                raise StepError(f"the server exited {p.returncode} (log {log.name})")
            if time.monotonic() > deadline:
                raise StepError("the server was not ready in time")
            time.sleep(0.02)
        with open(ready) as f:
            self.port = int(f.read())
        answer = self.first_answer(t0)
        self.tokens = self.http("POST", "/generate")["tokens"]
        health = self.http("GET", "/health")
        self.hook_port = int(health.get("hook_port") or self.port)
        self.digest = self.http("GET", "/digest", timeout=self.a.step_timeout)
        return {"answer_s": answer, "server_times": health.get("times"), "loaded_with": health.get("loaded_with"),
                "digest": self.digest, "tokens": self.tokens, "pid": self.pid, "helper": health.get("helper")}

    def baseline(self) -> dict[str, Any]:
        from sandbox.criu.runner import DumpOptions
        r: dict[str, Any] = {}
        images = os.path.join(self.work, "baseline")
        os.mkdir(images)
        drv = None
        if self.a.device == "cuda":
            from sandbox.gpu.checkpoint import checkpoint_all, restore_all
            from sandbox.gpu.driver import CudaDriver
            drv = CudaDriver()
            t = time.perf_counter()
            checkpoint_all(drv, [self.pid])
            r["driver_lock+checkpoint"] = time.perf_counter() - t
        t = time.perf_counter()
        self.criu.dump(self.pid, images, DumpOptions(skip_in_flight=True), timeout=self.a.step_timeout)
        os.sync()
        r["criu_dump+sync"] = time.perf_counter() - t
        r["dump_s"] = r["criu_dump+sync"] + r.get("driver_lock+checkpoint", 0.0)
        self.gone()
        r["image_bytes"] = sum(os.path.getsize(os.path.join(images, f)) for f in os.listdir(images))
        drop_caches(required=os.geteuid() == 0)
        t0 = time.perf_counter()
        self.criu.restore(images, detach=True)
        r["criu_restore"] = time.perf_counter() - t0
        if drv is not None:
            t = time.perf_counter()
            restore_all(drv, [self.pid])
            r["driver_restore+unlock"] = time.perf_counter() - t
        r["answer_s"] = self.first_answer(t0)
        r["restore_s"] = r["answer_s"]
        r["digest"] = self.check_digest()
        shutil.rmtree(images, ignore_errors=True)
        return r

    def restore(self, name: str, kv_kept: bool, resume: bool, cold: bool = True) -> dict[str, Any]:
        """Kill the server if it runs, drop the page cache, `criu restore NAME` -> first answer."""
        self.kill_server()
        if cold:
            drop_caches(required=os.geteuid() == 0)
        args = ["criu", "restore", name]
        if resume and self.has_hooks:
            args += ["--resume", f"http://127.0.0.1:{self.hook_port}/resume"]
        t0 = time.perf_counter()
        rep = self.gpusnap(*args)
        r: dict[str, Any] = {"restore_cmd_s": time.perf_counter() - t0, "stages": rep.get("seconds"),
                             "warm": rep.get("warm"), "served": (rep.get("stages") or {}).get("served")}
        if resume and not self.has_hooks:
            t = time.perf_counter()
            self.http("POST", "/resume", timeout=self.a.step_timeout)
            r["resume_emulated_s"] = time.perf_counter() - t
        r["answer_s"] = self.first_answer(t0)
        r["answer_after_restore_s"] = r["answer_s"] - r["restore_cmd_s"] - r.get("resume_emulated_s", 0.0)
        r["digest"] = self.check_digest(kv_kept)
        return r

    def dump(self, name: str, *extra: str, prepare: bool = False) -> dict[str, Any]:
        args = ["criu", "dump", "--skip-in-flight", *extra]
        emulated = 0.0
        if prepare and self.has_hooks:
            args += ["--prepare", f"http://127.0.0.1:{self.hook_port}/prepare",
                     "--resume", f"http://127.0.0.1:{self.hook_port}/resume"]
        t0 = time.perf_counter()
        if prepare and not self.has_hooks:
            self.http("POST", "/prepare", timeout=self.a.step_timeout)
            emulated = time.perf_counter() - t0
        rep = self.gpusnap(*args, str(self.pid), name)
        r = {"dump_s": time.perf_counter() - t0, "stages": rep.get("seconds"), "new_bytes": rep.get("new_bytes"),
             "raw_bytes": rep.get("raw_bytes"), "dedup_bytes": rep.get("dedup_bytes"),
             "ingest": rep.get("stages"), "prepare_emulated_s": emulated or None}
        if "--leave-running" not in extra:
            self.gone()
        return r

    def nvme(self) -> dict[str, Any]:
        d = self.dump("nvme")
        r = self.restore("nvme", kv_kept=True, resume=False)
        return {"dump": d, **r, "stored_bytes": d["new_bytes"]}

    def second(self) -> dict[str, Any]:
        first = self.dump("first", "--leave-running")
        changed = self.http("POST", "/kv/dirty?pct=5", timeout=self.a.step_timeout)["bytes"]
        d2 = self.dump("second", "--leave-running", "--parent", "first")
        self.digest = self.http("GET", "/digest", timeout=self.a.step_timeout)  # the KV pool changed
        return {"first": first, "second": d2, "changed_bytes": changed,
                "time_ratio": d2["dump_s"] / first["dump_s"],
                "bytes_over_changed": (d2["new_bytes"] or 0) / max(1, changed),
                "bytes_over_first": (d2["new_bytes"] or 0) / max(1, first["new_bytes"] or 1)}

    def warm(self) -> dict[str, Any]:
        d = self.dump("warmsnap")  # the state as it is now (after `second`'s change)
        w = self.gpusnap("store", "warm", "warmsnap")
        r = self.restore("warmsnap", kv_kept=True, resume=False, cold=True)
        return {"dump": d, "store_warm": w.get("list", w), **r}

    def hooks(self) -> dict[str, Any]:
        d = self.dump("hooked", prepare=True)
        r = self.restore("hooked", kv_kept=False, resume=True)
        out = {"dump": d, "hooks": "gpusnap --prepare/--resume" if self.has_hooks else "emulated by the bench",
               "nvme": r, "stored_bytes": d["new_bytes"]}
        self.result["steps"]["hooks"] = out
        self.save()
        w = self.gpusnap("store", "warm", "hooked")
        out["store_warm"] = w.get("list", w)
        out["warm"] = self.restore("hooked", kv_kept=False, resume=True, cold=True)
        out["answer_s"] = r["answer_s"]
        return out

    def inplace(self) -> dict[str, Any]:
        if self.a.device != "cuda":
            raise StepError("gpu checkpoint/restore need a GPU")
        t0 = time.perf_counter()
        c = self.gpusnap("gpu", "checkpoint", str(self.pid), "inplace")
        t1 = time.perf_counter()
        g = self.gpusnap("gpu", "restore", "inplace", str(self.pid))
        answer = self.first_answer(t1)
        return {"checkpoint_s": t1 - t0, "checkpoint": c.get("seconds"), "restore": g.get("seconds"),
                "answer_s": answer, "digest": self.check_digest(), "stored_bytes": c.get("new_bytes")}

    # ---------------------------------------------------------------- the run
    def run(self) -> None:
        try:
            self.result["hooks_available"] = self.has_hooks
            self.step("model", self.prepare_model)
            if os.geteuid() == 0 and "floor" not in self.a.skip:
                self.step("floor", lambda: disk_floor(self.work, min(4.0, max(1.0, self.a.gb / 4))))
            self.step("cold", self.cold)
            if self.tokens is None:
                raise StepError("no cold start: nothing else can be compared")
            for name, fn in (("baseline", self.baseline), ("nvme", self.nvme), ("second", self.second),
                             ("warm", self.warm), ("hooks", self.hooks), ("inplace", self.inplace)):
                if name in self.a.steps:
                    if not self.alive():
                        self.result["errors"][name] = "skipped: the server is not running"
                        continue
                    self.step(name, fn)
                    self.drop(*DROP.get(name, ()))
        finally:
            self.cleanup()
            self.result["ratios"] = ratios(self.result)
            self.result["finished"] = time.time()
            self.save()
            table(self.result)

    def drop(self, *names: str) -> None:
        """Snapshots no later step needs: out of the warm tier, removed, their packs reclaimed (a 64 GiB disk
        holds the model, the baseline's images and one or two snapshots of 30 GB of GPU state, not all)."""
        if self.a.keep:
            return
        for args in (["store", "cool", *names], ["store", "rm", *names], ["store", "gc"]):
            try:
                self.gpusnap(*args)
            except (StepError, subprocess.TimeoutExpired, ValueError) as e:
                self.result["errors"].setdefault("cleanup", str(e))

    def alive(self) -> bool:
        try:
            self.http("GET", "/health", timeout=10)
            return True
        except (OSError, urllib.error.URLError, json.JSONDecodeError):
            return False

    def cleanup(self) -> None:
        self.kill_server()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        if os.path.ismount(self.warm_dir):
            subprocess.run(["umount", self.warm_dir], check=False, timeout=60)
        if not self.a.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def floor_s(result: dict[str, Any], stored: int | None) -> float | None:
    """Stored bytes at the cold read rate + the driver's restore (the baseline's)."""
    fl = result["steps"].get("floor") or {}
    rate = fl.get("read4_gbps") or fl.get("read1_gbps")
    if not stored or not rate:
        return None
    drv = (result["steps"].get("baseline") or {}).get("driver_restore+unlock", 0.0)
    return float(stored / 1e9 / rate + drv)


def ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    s = result["steps"]
    cold = (s.get("cold") or {}).get("answer_s")
    base = (s.get("baseline") or {}).get("answer_s")
    rows: list[dict[str, Any]] = []

    def row(name: str, secs: float | None, stored: int | None, stages: Any, ok: Any) -> None:
        if secs is None:
            return
        fl = floor_s(result, stored)
        rows.append({"what": name, "answer_s": secs, "vs_cold": secs / cold if cold else None,
                     "vs_baseline": secs / base if base else None, "floor_s": fl, "stages": stages, "exact": ok})

    row("cold start", cold, None, (s.get("cold") or {}).get("server_times"), True)
    b = s.get("baseline") or {}
    row("driver API + plain CRIU (baseline)", base, b.get("image_bytes"),
        {k: b.get(k) for k in ("criu_restore", "driver_restore+unlock")}, (b.get("digest") or {}).get("ok"))
    n = s.get("nvme") or {}
    row("gpusnap criu restore, NVMe", n.get("answer_s"), n.get("stored_bytes"), n.get("stages"),
        (n.get("digest") or {}).get("ok"))
    w = s.get("warm") or {}
    row("gpusnap criu restore, warm tier", w.get("answer_s"), None, w.get("stages"), (w.get("digest") or {}).get("ok"))
    h = s.get("hooks") or {}
    hn = h.get("nvme") or {}
    row("with hooks, NVMe", hn.get("answer_s"), h.get("stored_bytes"), hn.get("stages"), (hn.get("digest") or {}).get("ok"))
    hw = h.get("warm") or {}
    row("with hooks, warm tier", hw.get("answer_s"), None, hw.get("stages"), (hw.get("digest") or {}).get("ok"))
    i = s.get("inplace") or {}
    row("gpu checkpoint + gpu restore in place", i.get("answer_s"), None, i.get("restore"),
        (i.get("digest") or {}).get("ok"))
    return rows


def table(result: dict[str, Any]) -> None:
    print(f"\n{'path':42} {'answer s':>9} {'vs cold':>8} {'vs base':>8} {'floor s':>8}  exact")
    for r in result.get("ratios") or []:
        f = (lambda v, p=2: f"{v:.{p}f}" if isinstance(v, (int, float)) else "-")
        print(f"{r['what']:42} {f(r['answer_s']):>9} {f(r['vs_cold']):>8} {f(r['vs_baseline']):>8} "
              f"{f(r['floor_s']):>8}  {r['exact']}")
    sec = result["steps"].get("second")
    if sec:
        print(f"second dump (--parent, 5% of the KV pool changed): {sec['second']['dump_s']:.2f} s vs first "
              f"{sec['first']['dump_s']:.2f} s = {sec['time_ratio']:.2f}x; wrote {sec['second']['new_bytes']} bytes = "
              f"{sec['bytes_over_changed']:.2f}x the {sec['changed_bytes']} changed")
    for k, v in result.get("errors", {}).items():
        if not k.endswith(":trace"):
            print(f"ERROR {k}: {v}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=16.0, help="GB of bf16 weights (default 16: ~30 GB of GPU state "
                    "with the KV pool, the prefix cache and what the allocator keeps)")
    ap.add_argument("--kv-gb", type=float, default=12.0)
    ap.add_argument("--quick", action="store_true", help="~2 GB of state: a shake-out run in under 3 minutes")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dir", default="/var/tmp", help="the work directory's parent (the NVMe disk)")
    ap.add_argument("--cache-dir", default=None, help="where the model's safetensors are kept (default DIR/gpusnap-bench-models)")
    ap.add_argument("--out", default=None, help="JSON written after every step")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--skip", default="", help="comma-separated: floor")
    ap.add_argument("--step-timeout", type=float, default=300.0)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (stores, logs)")
    a = ap.parse_args()
    if a.quick:
        a.gb, a.kv_gb = 1.5, 0.5
    a.steps = [s for s in a.steps.split(",") if s]
    a.skip = [s for s in a.skip.split(",") if s]
    a.cache_dir = a.cache_dir or os.path.join(a.dir, "gpusnap-bench-models")
    b = Bench(a)

    def stop(signum: int, _: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop)
    b.run()
    return 0 if not b.result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
