"""Issue 23's batch on a two-GPU machine (nvidia-h200-x2): run by scripts/device/two_gpu.sh.

Steps (--steps, comma-separated, in this order by default):
  env   the machine: GPUs, driver, how they are linked (nvidia-smi topo -m), the multicast variables
  a     one process with memory on both GPUs: `gpu checkpoint`/`gpu restore` in place, then
        `criu dump`/`criu restore` (when CRIU is here), the process checking its data after each
  c     restores onto the other GPU (`--device-map 0=1,1=0`): a one-GPU process (NVML shows its memory
        moved), the two-GPU process, through `criu restore` too; and the refusals on real GPUs: a GPU
        not there (4), a map missing the GPU it held (2), a target without the free memory (4, a second process
        holding most of GPU 1), each with the process left CHECKPOINTED and then restored in place
  d     checkpoint/restore GB/s: one process on one GPU, two processes one per GPU (in parallel), one
        process on both GPUs; per GPU and in total
  b     two tensor-parallel workers in one tree (torch.distributed, nccl), under NCCL settings from the
        defaults to the most conservative: checkpoint/restore of the tree and an all-reduce after it,
        then the same onto swapped GPUs, then CRIU of the tree; every failure recorded with its one line
Every result is a JSON line in OUT/two-gpu.jsonl ({"step", "check", "ok", ...}); the workers' logs go
to OUT/tp-logs.txt. A step that fails records why and the batch goes on to the next.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GIB = 1 << 30


class Batch:
    def __init__(self, out: str, store: str) -> None:
        self.out, self.store = out, store
        self.results = open(os.path.join(out, "two-gpu.jsonl"), "a")
        self.t0 = time.monotonic()
        self.n = 0

    def emit(self, step: str, check: str, ok: bool | None, **data: Any) -> None:
        line = json.dumps({"step": step, "check": check, "ok": ok, "t": round(time.monotonic() - self.t0, 1), **data},
                          default=str)
        print(line, flush=True)
        self.results.write(line + "\n")
        self.results.flush()

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}-{self.n}"

    def gpusnap(self, *args: str, timeout: float = 300) -> tuple[int, Any, str]:
        """(exit code, the --json report or None, stderr's last line) of `gpusnap ARGS --json`."""
        p = subprocess.run([sys.executable, "-m", "cli", "--store", self.store, *args, "--json"], capture_output=True,
                           text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **NO_MULTICAST})
        try:
            doc = json.loads(p.stdout) if p.stdout.strip() else None
        except ValueError:
            doc = None
        err = (p.stderr.strip().splitlines() or [""])[-1]
        return p.returncode, doc, err

    def meta(self, name: str) -> dict[str, Any]:
        rc, doc, err = self.gpusnap("store", "inspect", name)
        return doc["meta"] if rc == 0 and doc else {"error": err}


def criu_here() -> bool:
    from sandbox.criu.runner import find_criu
    return os.geteuid() == 0 and bool(find_criu())


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds else None


# ---- env -------------------------------------------------------------------------------------------
def step_env(b: Batch, a: argparse.Namespace) -> None:
    from sandbox.gpu.driver import CudaDriver, probe
    drv = CudaDriver()
    from sandbox.gpu import nvml
    t0 = time.perf_counter()
    mem = nvml.memory()
    t1 = time.perf_counter()
    procs = nvml.process_memory([os.getpid()])
    b.emit("env", "NVML (what --device-map checks with; its cost is paid by every checkpoint)", mem is not None,
           memory=mem, first_call_s=round(t1 - t0, 4), process_call_s=round(time.perf_counter() - t1, 4),
           this_process=procs)
    f = probe(drv)
    b.emit("env", "probe", f.checkpoint_api, driver=f.driver_version, path=f.path, reason=f.reason,
           gpus=[{"index": g.index, "name": g.name, "uuid": g.uuid, "total": g.total_bytes, "free": g.free_bytes}
                 for g in f.gpus])
    b.emit("env", "multicast off", all(os.environ.get(k) == v for k, v in NO_MULTICAST.items()),
           env={k: os.environ.get(k) for k in [*NO_MULTICAST, "NCCL_CUMEM_ENABLE"]})
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
    b.emit("env", "topology", topo.returncode == 0, topo=topo.stdout.strip().splitlines()[:8])
    b.emit("env", "criu", criu_here(), criu=os.environ.get("GPUSNAP_CRIU"))
    if len(f.gpus) < 2:
        raise RuntimeError(f"{len(f.gpus)} GPU(s) here: this batch needs two")


# ---- a: one process on both GPUs, in place --------------------------------------------------------
def step_a(b: Batch, a: argparse.Namespace) -> None:
    from scripts.workloads.workload_control import Workload
    with Workload(a.gb, script="multi_gpu_workload.py", seed=3) as w:
        total = w.size * w.info["gpus"]
        name = b.name("a-gpu")
        rc, ck, err = b.gpusnap("gpu", "checkpoint", str(w.pid), name)
        b.emit("a", "gpu checkpoint, process on both GPUs", rc == 0, err=err, report=ck,
               gpu_bytes=b.meta(name).get("gpu_bytes"))
        if rc != 0:
            return
        rc, rs, err = b.gpusnap("gpu", "restore", name, str(w.pid))
        v = w.cmd("verify") if rc == 0 else {"ok": False}
        b.emit("a", "gpu restore in place, data verified", rc == 0 and v["ok"], err=err, report=rs, verify=v,
               checkpoint_GBps=gbps(total, (ck or {}).get("seconds", {}).get("checkpoint")),
               restore_GBps=gbps(total, (rs or {}).get("seconds", {}).get("restore")))
    if not criu_here():
        b.emit("a", "criu dump/restore", None, skipped="no CRIU here (carry .carry/criu, see two_gpu.sh)")
        return
    with Workload(a.gb, script="multi_gpu_workload.py", seed=4, detached=True) as w:
        name = b.name("a-criu")
        rc, d, err = b.gpusnap("criu", "dump", str(w.pid), name)
        b.emit("a", "criu dump, process on both GPUs", rc == 0, err=err, report=d)
        if rc != 0:
            return
        w.reap()
        rc, r, err = b.gpusnap("criu", "restore", name)
        v = w.cmd("verify") if rc == 0 else {"ok": False}
        b.emit("a", "criu restore, data verified", rc == 0 and v["ok"], err=err, report=r, verify=v)


# ---- c: onto the other GPU, and the refusals --------------------------------------------------------
def _held(pid: int) -> dict[str, int]:
    from sandbox.gpu.driver import CudaDriver
    return (CudaDriver().gpu_bytes([pid]) or {}).get(pid, {})


def _state(pid: int) -> str:
    from sandbox.gpu.driver import CudaDriver
    try:
        return CudaDriver().get_state(pid).name
    except Exception as e:  # noqa: BLE001
        return f"? {e}"


def step_c(b: Batch, a: argparse.Namespace) -> None:
    from sandbox.gpu.driver import CudaDriver
    from scripts.workloads.workload_control import Workload
    gpus = CudaDriver().gpus()
    u0, u1 = gpus[0].uuid, gpus[1].uuid
    with Workload(a.gb, seed=5) as w:
        before = _held(w.pid)
        name = b.name("c-one")
        rc, _, err = b.gpusnap("gpu", "checkpoint", str(w.pid), name)
        b.emit("c", "gpu checkpoint, process on GPU 0", rc == 0, err=err, held=before)
        if rc != 0:
            return
        need = b.meta(name).get("gpu_bytes", {}).get(str(w.pid), {}).get(u0, 0)
        for items, code in ((["0=2,1=1"], 4), (["1=0"], 2)):  # no GPU 2; GPU 0, which it held, not mapped
            rc, _, err = b.gpusnap("gpu", "restore", name, str(w.pid), *[x for i in items for x in ("--device-map", i)])
            b.emit("c", f"refused: --device-map {' '.join(items)}", rc == code and _state(w.pid) == "CHECKPOINTED",
                   rc=rc, want=code, err=err, state=_state(w.pid))
        # a second process holds most of GPU 1: the swap must be refused for memory, before anything is restored
        free1 = next(g.free_bytes for g in CudaDriver().gpus() if g.uuid == u1)
        hog_bytes = max(0, (free1 or 0) - need // 2)
        hog = subprocess.Popen([sys.executable, "-c", "import sys,time,torch; x=torch.empty(int(sys.argv[1]), "
                                "dtype=torch.uint8, device='cuda:1'); print('held', flush=True); time.sleep(600)",
                                str(hog_bytes)], stdout=subprocess.PIPE, text=True, env={**os.environ, **NO_MULTICAST})
        try:
            held = hog.stdout.readline().strip() if hog.stdout else ""
            rc, _, err = b.gpusnap("gpu", "restore", name, str(w.pid), "--device-map", "0=1,1=0")
            b.emit("c", "refused: target GPU without the free memory", rc == 4 and _state(w.pid) == "CHECKPOINTED",
                   rc=rc, err=err, need=need, hog=hog_bytes, hog_says=held, state=_state(w.pid))
        finally:
            hog.kill()
            hog.wait()
        rc, r, err = b.gpusnap("gpu", "restore", name, str(w.pid), "--device-map", "0=1,1=0")
        ok = rc == 0 and w.verify()
        after = _held(w.pid)
        b.emit("c", "gpu restore --device-map 0=1,1=0 (one-GPU process), data verified, memory now on GPU 1",
               ok and set(after) == {u1}, err=err, report=r, held_before=before, held_after=after)
    with Workload(a.gb, script="multi_gpu_workload.py", seed=6) as w:
        name = b.name("c-both")
        rc, _, err = b.gpusnap("gpu", "checkpoint", str(w.pid), name)
        if rc == 0:
            rc, r, err = b.gpusnap("gpu", "restore", name, str(w.pid), "--device-map", "0=1,1=0")
        v = w.cmd("verify") if rc == 0 else {"ok": False}
        b.emit("c", "gpu restore --device-map 0=1,1=0 (process on both GPUs), data verified", rc == 0 and v["ok"],
               err=err, verify=v, uuids_before=w.info["uuids"], uuids_inside_after=w.cmd("where").get("uuids"))
    if not criu_here():
        b.emit("c", "criu restore --device-map", None, skipped="no CRIU here")
        return
    with Workload(a.gb, seed=7, detached=True) as w:
        name = b.name("c-criu")
        rc, _, err = b.gpusnap("criu", "dump", str(w.pid), name)
        if rc == 0:
            w.reap()
            rc, r, err = b.gpusnap("criu", "restore", name, "--device-map", "0=1,1=0")
        ok = rc == 0 and w.verify()
        after = _held(w.pid) if rc == 0 else {}
        b.emit("c", "criu restore --device-map 0=1,1=0, data verified, memory now on GPU 1", ok and set(after) == {u1},
               err=err, held_after=after)


# ---- d: GB/s per GPU ---------------------------------------------------------------------------------
def _timed(pids: list[int]) -> dict[str, Any]:
    from sandbox.gpu.checkpoint import checkpoint_all, restore_all
    from sandbox.gpu.driver import CudaDriver
    drv = CudaDriver()
    t = checkpoint_all(drv, pids)
    r = restore_all(drv, pids)
    return {"lock_s": t.lock_s, "checkpoint_s": t.checkpoint_s, "restore_s": r.restore_s, "unlock_s": r.unlock_s,
            "per_pid_checkpoint_s": t.per_pid, "per_pid_restore_s": r.per_pid}


def step_d(b: Batch, a: argparse.Namespace) -> None:
    from scripts.workloads.workload_control import Workload
    gb = a.bench_gb
    for rep in range(a.repeat):
        with Workload(gb, mix="pessimistic", seed=11) as w:
            t = _timed([w.pid])
            b.emit("d", "one process, one GPU", w.verify(), rep=rep, gb=w.size / 1e9, **t,
                   checkpoint_GBps=gbps(w.size, t["checkpoint_s"]), restore_GBps=gbps(w.size, t["restore_s"]))
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        ws = []
        try:
            for g in (0, 1):
                os.environ["CUDA_VISIBLE_DEVICES"] = str(g)
                ws.append(Workload(gb, mix="pessimistic", seed=12 + g))
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        try:
            t = _timed([w.pid for w in ws])
            total = sum(w.size for w in ws)
            b.emit("d", "two processes, one per GPU, in parallel", all(w.verify() for w in ws), rep=rep,
                   gb_total=total / 1e9, **t, checkpoint_GBps_total=gbps(total, t["checkpoint_s"]),
                   restore_GBps_total=gbps(total, t["restore_s"]),
                   checkpoint_GBps_per_gpu=[gbps(w.size, t["per_pid_checkpoint_s"].get(w.pid)) for w in ws],
                   restore_GBps_per_gpu=[gbps(w.size, t["per_pid_restore_s"].get(w.pid)) for w in ws])
        finally:
            for w in ws:
                w.close()
        with Workload(gb, mix="pessimistic", script="multi_gpu_workload.py", seed=13) as w:
            t = _timed([w.pid])
            total = w.size * w.info["gpus"]
            b.emit("d", "one process on both GPUs", w.cmd("verify")["ok"], rep=rep, gb_total=total / 1e9, **t,
                   checkpoint_GBps_total=gbps(total, t["checkpoint_s"]), restore_GBps_total=gbps(total, t["restore_s"]))


# ---- b: tensor-parallel workers with NCCL ---------------------------------------------------------
VARIANTS = {
    "nccl-defaults": {},
    "cumem-off": {"NCCL_CUMEM_ENABLE": "0"},
    "cumem-off,p2p-off": {"NCCL_CUMEM_ENABLE": "0", "NCCL_P2P_DISABLE": "1"},
    "cumem-off,p2p-off,shm-off": {"NCCL_CUMEM_ENABLE": "0", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}


def _allreduce(tree: Any, timeout: float = 60) -> dict[str, Any]:
    try:
        res = tree.cmd_all("allreduce", timeout=timeout)
        return {"ok": all(r["ok"] for r in res), "ranks": res}
    except Exception as e:  # noqa: BLE001 - a hang or a dead worker is the finding
        return {"ok": False, "error": str(e)}


def _tp_round(b: Batch, tree: Any, variant: str, swap: bool) -> bool:
    what = "swapped GPUs" if swap else "in place"
    name = b.name("b")
    rc, ck, err = b.gpusnap("gpu", "checkpoint", str(tree.pid), name, timeout=120)
    b.emit("b", f"[{variant}] gpu checkpoint of the tree", rc == 0, err=err, report=ck,
           states={p: _state(p) for p in tree.workers})
    if rc != 0:  # refused or rolled back: the workers must run on with their data and communicator
        ar = _allreduce(tree)
        v = tree.cmd_all("verify") if ar["ok"] else []
        b.emit("b", f"[{variant}] after the failed checkpoint: every worker RUNNING, all-reduce and data intact",
               ar["ok"] and all(x["ok"] for x in v) and all(_state(p) == "RUNNING" for p in tree.workers),
               allreduce=ar, verify=v, states={p: _state(p) for p in tree.workers})
        return False
    args = ["--device-map", "0=1,1=0"] if swap else []
    rc, rs, err = b.gpusnap("gpu", "restore", name, str(tree.pid), *args, timeout=120)
    b.emit("b", f"[{variant}] gpu restore ({what})", rc == 0, err=err, report=rs,
           states={p: _state(p) for p in tree.workers})
    if rc != 0:
        return False
    ar = _allreduce(tree)
    v = tree.cmd_all("verify") if ar["ok"] else []
    b.emit("b", f"[{variant}] all-reduce after restore ({what}) gives the right sum, data verified",
           ar["ok"] and all(x["ok"] for x in v), allreduce=ar, verify=v,
           where=tree.cmd_all("where") if ar["ok"] else None)
    return ar["ok"]


def step_b(b: Batch, a: argparse.Namespace) -> None:
    from scripts.workloads.tp_workload import TpTree
    logs = open(os.path.join(b.out, "tp-logs.txt"), "a")
    for variant, env in VARIANTS.items():
        if a.variants and variant not in a.variants.split(";"):
            continue
        try:
            tree = TpTree(a.tp_gb, env=env)
        except Exception as e:  # noqa: BLE001
            b.emit("b", f"[{variant}] start the tree", False, err=str(e)[-1500:])
            continue
        try:
            pre = _allreduce(tree)
            b.emit("b", f"[{variant}] all-reduce before", pre["ok"], env=env, pids=[tree.pid, *tree.workers], allreduce=pre)
            if pre["ok"] and _tp_round(b, tree, variant, swap=False):
                _tp_round(b, tree, variant, swap=True)
            if criu_here():
                name = b.name("b-criu")
                rc, d, err = b.gpusnap("criu", "dump", str(tree.pid), name, "--tcp-established", "--ext-unix-sk",
                                       timeout=180)
                b.emit("b", f"[{variant}] criu dump of the tree", rc == 0, err=err, report=d)
                if rc == 0:
                    try:
                        tree.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                    rc, r, err = b.gpusnap("criu", "restore", name, timeout=180)
                    b.emit("b", f"[{variant}] criu restore of the tree", rc == 0, err=err, report=r)
                    if rc == 0:
                        ar = _allreduce(tree)
                        b.emit("b", f"[{variant}] all-reduce after criu restore", ar["ok"], allreduce=ar)
        except Exception as e:  # noqa: BLE001
            b.emit("b", f"[{variant}] error", False, err=f"{type(e).__name__}: {e}",
                   trace=traceback.format_exc()[-1500:])
        finally:
            logs.write(f"==== {variant}\n{tree.log_tail(20000)}\n")
            logs.flush()
            tree.close()


STEPS: dict[str, Callable[[Batch, argparse.Namespace], None]] = {"env": step_env, "a": step_a, "c": step_c,
                                                                 "d": step_d, "b": step_b}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "two-gpu-out"))
    ap.add_argument("--store", default="/tmp/gpusnap-two-gpu-store")
    ap.add_argument("--steps", default="env,a,c,d,b")
    ap.add_argument("--gb", type=float, default=4, help="GB per GPU for steps a and c")
    ap.add_argument("--bench-gb", type=float, default=8, help="GB per GPU for step d")
    ap.add_argument("--tp-gb", type=float, default=1, help="GB per worker for step b")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--variants", default="", help="step b's NCCL variants, ';'-separated (default: all)")
    a = ap.parse_args()
    for k, v in NO_MULTICAST.items():
        if os.environ.get(k) != v:
            raise SystemExit(f"two_gpu: {k}={v} must be set in the environment (NVLink multicast stays off)")
    os.makedirs(a.out, exist_ok=True)
    b = Batch(a.out, a.store)
    for s in a.steps.split(","):
        t0 = time.monotonic()
        try:
            STEPS[s](b, a)
            b.emit(s, "step done", True, seconds=round(time.monotonic() - t0, 1))
        except Exception as e:  # noqa: BLE001 - record it, go on
            b.emit(s, "step failed", False, err=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
            if s == "env":
                break


if __name__ == "__main__":
    main()
