#!/usr/bin/env python3
"""Tensor-parallel workers in one process tree: a parent (no CUDA) and WORLD workers, one per GPU,
joined by an NCCL communicator (torch.distributed, backend nccl), for scripts/device/two_gpu.py.

Each worker holds --gb GB of known data on its GPU (gpu_workload.py's recipe, seeds of its rank) and
has run one all-reduce before it says ready (so the communicator, its buffers and its peer mappings
exist when the tree is checkpointed). Worker commands (command_loop protocol, one dir per rank):
verify | allreduce (every rank must get it: x = rank+1 everywhere, summed; ok when every element is
WORLD*(WORLD+1)/2) | where (the UUID of its device now) | exit.

NVLink multicast stays off in every process this starts (NCCL_NVLS_ENABLE=0 and the other variables
the GPU machines' notes name): a worker refuses to start without them.

TpTree drives it from a test or script (no torch imported there).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def worker(a: argparse.Namespace) -> None:
    for k, v in NO_MULTICAST.items():
        if os.environ.get(k) != v:
            raise SystemExit(f"tp_workload: {k}={v} must be set (NVLink multicast stays off)")
    import torch
    import torch.distributed as dist
    from scripts.workloads.command_loop import announce, serve
    from scripts.workloads.gpu_workload import BLOCK, fill, kind
    rank, world = a.rank, a.world
    torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    size = int(a.gb * (1 << 30)) // BLOCK * BLOCK
    mem = torch.empty(size, dtype=torch.uint8, device=dev)
    seeds = [(a.seed * 1000 + rank) * 100003 + i for i in range(size // BLOCK)]
    kinds = [kind("realistic", i) for i in range(len(seeds))]
    for i, s in enumerate(seeds):
        fill(mem[i * BLOCK:(i + 1) * BLOCK], kinds[i], s)

    def allreduce() -> dict[str, Any]:
        x = torch.full((1 << 20,), float(rank + 1), device=dev)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        want = world * (world + 1) / 2
        return {"ok": bool(torch.all(x == want).item()), "got": float(x[0].item()), "want": want,
                "seconds": time.perf_counter() - t0}

    first = allreduce()
    if not first["ok"]:
        raise SystemExit(f"tp_workload rank {rank}: the first all-reduce gave {first['got']}, not {first['want']}")
    uuid = str(torch.cuda.get_device_properties(rank).uuid)
    os.makedirs(os.path.join(a.dir, f"rank{rank}"), exist_ok=True)
    announce(os.path.join(a.dir, f"rank{rank}"), {"pid": os.getpid(), "rank": rank, "size": size, "uuid": uuid})

    def handle(cmd: list[str]) -> dict[str, Any] | None:
        if cmd[0] == "verify":
            scratch = torch.empty(BLOCK, dtype=torch.uint8, device=dev)
            bad = []
            for i, s in enumerate(seeds):
                fill(scratch, kinds[i], s)
                if not torch.equal(scratch, mem[i * BLOCK:(i + 1) * BLOCK]):
                    bad.append(i)
            return {"ok": not bad, "bad_blocks": bad[:20]}
        if cmd[0] == "allreduce":
            return allreduce()
        if cmd[0] == "where":
            return {"ok": True, "uuid": str(torch.cuda.get_device_properties(rank).uuid)}
        return {"ok": False, "error": f"unknown command {cmd[0]!r}"}

    try:
        serve(os.path.join(a.dir, f"rank{rank}"), handle, torch.cuda.synchronize)
    finally:
        dist.destroy_process_group()


def parent(a: argparse.Namespace) -> None:
    """Start the workers (the tree's root holds no CUDA), say ready with every pid, wait for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **NO_MULTICAST, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    kids = [subprocess.Popen([sys.executable, "-m", "scripts.workloads.tp_workload", "--worker", "--rank", str(r),
                              "--world", str(a.world), "--gb", str(a.gb), "--seed", str(a.seed), "--dir", a.dir],
                             env=env, cwd=ROOT) for r in range(a.world)]
    ranks = [os.path.join(a.dir, f"rank{r}", "ready") for r in range(a.world)]
    while not all(os.path.exists(r) for r in ranks):
        if any(k.poll() is not None for k in kids):
            for k in kids:
                k.kill()
            raise SystemExit("tp_workload: a worker exited before it was ready: " +
                             ", ".join(f"rank {r}: {k.poll()}" for r, k in enumerate(kids)))
        time.sleep(0.05)
    from scripts.workloads.command_loop import announce
    announce(a.dir, {"pid": os.getpid(), "workers": [k.pid for k in kids], "port": port})
    for k in kids:
        k.wait()


class TpTree:
    """The tree, started in its own session (stdio to a log, as CRIU wants it), driven by files."""

    def __init__(self, gb: float, world: int = 2, seed: int = 1, env: dict[str, str] | None = None,
                 timeout: float = 300) -> None:
        self.dir = tempfile.mkdtemp(prefix="gpusnap-tp-")
        self.world = world
        self.log = open(os.path.join(self.dir, "log"), "w")
        e = {**os.environ, **(env or {}), **NO_MULTICAST,
             "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "scripts.workloads.tp_workload", "--world", str(world),
                                      "--gb", str(gb), "--seed", str(seed), "--dir", self.dir],
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     start_new_session=True, cwd=ROOT, env=e)
        deadline = time.monotonic() + timeout
        ready = os.path.join(self.dir, "ready")
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"tp tree not ready (exit {self.proc.poll()}): {self.log_tail()}")
            time.sleep(0.05)
        with open(ready) as f:
            self.info = json.load(f)
        self.pid: int = self.info["pid"]
        self.workers: list[int] = self.info["workers"]

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(os.path.join(self.dir, "log")) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def cmd_all(self, line: str, timeout: float = 120) -> list[dict[str, Any]]:
        """LINE to every rank at once (a collective needs them all), then every answer."""
        dirs = [os.path.join(self.dir, f"rank{r}") for r in range(self.world)]
        for d in dirs:
            done = os.path.join(d, "cmd.done")
            if os.path.exists(done):
                os.unlink(done)
        for d in dirs:
            with open(os.path.join(d, "cmd.tmp"), "w") as f:
                f.write(line)
            os.rename(os.path.join(d, "cmd.tmp"), os.path.join(d, "cmd"))
        out = []
        deadline = time.monotonic() + timeout
        for d in dirs:
            done = os.path.join(d, "cmd.done")
            while not os.path.exists(done):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{d}: no answer to {line!r} in {timeout:g} s")
                time.sleep(0.01)
            with open(done) as f:
                out.append(json.load(f))
        return out

    def close(self) -> None:
        import signal
        for p in [*getattr(self, "workers", []), getattr(self, "pid", self.proc.pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--gb", type=float, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    worker(a) if a.worker else parent(a)


if __name__ == "__main__":
    main()
