#!/usr/bin/env python3
"""A weights-dominated MoE-like process tree for the benchmarks: two CUDA processes, few zeros.

The parent holds the attention weights, a router and most experts (each expert's gate/up/down its
own bf16 allocation, N(0, 0.02)), a paged KV pool with 30% of its blocks filled at scattered places
(the rest zeros), pinned host memory holding bf16 values (a staging buffer, as serving engines keep)
and, on a GPU, a CUDA graph of one MoE step (router, top-2 experts). It starts a child process (an
expert-parallel worker: its own CUDA context, its share of the experts and its own KV pool, same
recipe) and talks to it over a pipe pair, so both are one process tree for CRIU and the driver.
--gb sizes the whole tree (--child-share of it in the child): ~70% weights, ~30% KV pool, so about a
fifth of the memory is zeros. `--mix moe-fp32` holds the weights (attention, router, experts) in fp32,
as a model loaded without a dtype is, the KV pool and pinned memory still bf16; any other --mix is bf16.

It checks itself: each process keeps an exact position-weighted integer checksum of every tensor it
holds (pinned host memory included) and `verify` recomputes them: every checksum must be equal (the
memory came back bit for bit); the graph's output must be within LOGITS_TOL of the one recorded
before (kernels may reduce in another order after a driver restore; serving_workload.py says more),
and whether it is bit-equal is reported. Control protocol as scripts/workloads/command_loop.py (a
fresh --dir: `ready`, then `cmd` -> `cmd.done`): verify | mutate PERCENT (fills that share of both
KV pools' empty blocks, at scattered places) | exit. `ready` names every pid of the tree (`pids`).

--device cpu runs the same tree with numpy arrays in place of device memory and no graph (no torch,
no GPU): the control protocol, the child and the checksums are tested that way on machines without one.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from scripts.workloads.command_loop import announce, serve

HIDDEN, INTER, EXPERTS_PER_LAYER, TOP_K = 2048, 5632, 8, 2
BLOCK_BYTES = 2 * 16 * 8 * 128 * 2  # one KV block: k/v x 16 tokens x 8 heads x 128 dims, bf16
KV_SHARE = 0.30      # of each process's bytes: its KV pool
KV_FILLED = 0.30     # of the KV pool's blocks: filled at scattered places
PINNED_SHARE = 0.02  # of the parent's bytes, at most PINNED_MAX: pinned host memory
PINNED_MAX = 256 << 20
LOGITS_TOL = 2e-2
STEP = 1 << 25       # checksum slices (bounds the temporaries)


def expert_bytes(fp32: bool = False) -> int:
    return 3 * HIDDEN * INTER * (4 if fp32 else 2)


# ----------------------------------------------------------------------------------- backends
class CpuBackend:
    """numpy arrays standing in for device memory (no torch, no GPU)."""

    name = "cpu"

    def __init__(self, seed: int, fp32: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.fp32 = fp32

    def weights(self, n: int) -> np.ndarray:
        """N weights N(0, 0.02) in the tree's weight dtype (bf16, or fp32 with --mix moe-fp32)."""
        return self.rng.normal(0, 0.02, n).astype(np.float32) if self.fp32 else self.bf16(n)

    def bf16(self, n: int) -> np.ndarray:
        f = self.rng.normal(0, 0.02, n).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)

    def zeros(self, n: int) -> np.ndarray:
        return np.zeros(n, np.uint16)

    def pinned(self, n: int) -> np.ndarray:
        return self.bf16(n)

    def put(self, a: np.ndarray, lo: int, vals: np.ndarray) -> None:
        a[lo:lo + vals.size] = vals

    def checksum(self, a: np.ndarray) -> int:
        """Exact too (a digest of the bytes), and far cheaper on a CPU than the weighted sum."""
        return int.from_bytes(hashlib.blake2b(a.data, digest_size=8).digest(), "little")

    def used(self, arrays: list[Any]) -> int:
        return sum(a.nbytes for a in arrays)

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass


class CudaBackend:
    """torch tensors on the GPU; pinned host memory through torch (cudaHostAlloc)."""

    name = "cuda"

    def __init__(self, seed: int, fp32: bool = False) -> None:
        import torch  # noqa: PLC0415
        self.torch = torch
        torch.backends.cuda.matmul.allow_tf32 = False
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.fp32 = fp32

    def weights(self, n: int) -> Any:
        """N weights N(0, 0.02) in the tree's weight dtype (bf16, or fp32 with --mix moe-fp32)."""
        t = self.torch
        w = t.randn(n, generator=self.gen, device="cuda", dtype=t.float32) * 0.02
        return w if self.fp32 else w.to(t.bfloat16)

    def bf16(self, n: int) -> Any:
        t = self.torch
        return (t.randn(n, generator=self.gen, device="cuda", dtype=t.float32) * 0.02).to(t.bfloat16)

    def zeros(self, n: int) -> Any:
        return self.torch.zeros(n, device="cuda", dtype=self.torch.bfloat16)

    def pinned(self, n: int) -> Any:
        out = self.torch.empty(n, dtype=self.torch.bfloat16, pin_memory=True)
        out.copy_(self.bf16(n).cpu())
        return out

    def put(self, a: Any, lo: int, vals: Any) -> None:
        a[lo:lo + vals.numel()].copy_(vals)

    def checksum(self, a: Any) -> int:
        t = self.torch
        v = a.view(t.int16).reshape(-1)
        acc = t.zeros((), dtype=t.int64, device=v.device)
        for lo in range(0, v.numel(), STEP):
            part = v[lo:lo + STEP].to(t.int64)
            w = t.arange(lo, lo + part.numel(), device=v.device, dtype=t.int64) % 1_000_003 + 1
            acc += (part * w).sum()
        return int(acc)

    def used(self, arrays: list[Any]) -> int:
        return int(self.torch.cuda.memory_allocated())

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def release(self) -> None:
        """Cached blocks back to the driver: what a checkpoint holds is the tensors (and the graph),
        not the checksums' temporaries (~1 GB of int64 slices that would differ at every pass)."""
        self.torch.cuda.empty_cache()


# -------------------------------------------------------------------------------- one process
class Shard:
    """What one process of the tree holds: experts, a KV pool 30% filled at scattered places, and
    (the parent) attention weights, a router and pinned host memory; each tensor's checksum."""

    def __init__(self, be: Any, nbytes: int, seed: int, parent: bool) -> None:
        self.be = be
        self.rng = np.random.default_rng(seed + 1000)
        kv_bytes = int(nbytes * KV_SHARE)
        self.experts = max(1, (nbytes - kv_bytes) // expert_bytes(be.fp32))
        e = HIDDEN * INTER
        self.tensors: list[Any] = []
        if parent:
            self.attn = [be.weights(HIDDEN * HIDDEN) for _ in range(4)]
            self.router = be.weights(HIDDEN * EXPERTS_PER_LAYER)
            self.tensors += [*self.attn, self.router]
        self.weights = [[be.weights(e) for _ in range(3)] for _ in range(self.experts)]  # gate, up, down
        self.tensors += [w for ex in self.weights for w in ex]
        self.blocks = max(16, kv_bytes // BLOCK_BYTES)
        self.block_elems = BLOCK_BYTES // 2
        self.kv = be.zeros(self.blocks * self.block_elems)
        self.filled = np.zeros(self.blocks, bool)
        self.fill(KV_FILLED * 100)
        self.tensors.append(self.kv)
        self.pinned = None
        if parent:
            n = min(PINNED_MAX, int(nbytes * PINNED_SHARE)) // 2
            self.pinned = be.pinned(max(n, 4096))
            self.tensors.append(self.pinned)
        be.sync()
        self.sums = self.checksums()

    def fill(self, percent: float) -> int:
        """Fill PERCENT of all blocks (at most the empty ones), chosen at random among the empty ones."""
        empty = np.flatnonzero(~self.filled)
        k = min(len(empty), max(1, round(self.blocks * percent / 100)))
        for b in np.sort(self.rng.choice(empty, k, replace=False)):
            self.be.put(self.kv, int(b) * self.block_elems, self.be.bf16(self.block_elems) * 50)
            self.filled[b] = True
        return k

    def checksums(self) -> list[int]:
        out = [self.be.checksum(t) for t in self.tensors]
        self.be.release()
        return out

    def verify(self) -> dict[str, Any]:
        now = self.checksums()
        bad = [i for i, (x, y) in enumerate(zip(now, self.sums)) if x != y]
        return {"ok": not bad, "tensors_equal": not bad, "bad_tensors": bad[:20], "tensors": len(now)}

    def mutate(self, percent: float) -> dict[str, Any]:
        k = self.fill(percent)
        self.be.sync()
        self.sums = self.checksums()
        return {"ok": True, "blocks": k, "bytes": k * BLOCK_BYTES}


class Graph:
    """One MoE step (router softmax, top-2 experts' SwiGLU MLP for a small batch) as a CUDA graph."""

    def __init__(self, be: CudaBackend, shard: Shard) -> None:
        t = be.torch
        self.t = t
        g = be.gen
        self.x = (t.randn(4, HIDDEN, generator=g, device="cuda") * 0.1).to(t.float32 if be.fp32 else t.bfloat16)
        router = shard.router.view(EXPERTS_PER_LAYER, HIDDEN)
        experts = [[w.view(INTER, HIDDEN) for w in ex] for ex in shard.weights[:EXPERTS_PER_LAYER]]

        def step() -> Any:
            p = t.softmax((self.x @ router.t()).float(), -1)
            top = t.topk(p, min(TOP_K, len(experts)), -1)
            out = t.zeros(4, HIDDEN, device="cuda", dtype=t.float32)
            for j, ex in enumerate(experts):  # dense over experts, masked: a static graph
                gate, up, down = ex
                h = t.nn.functional.silu(self.x @ gate.t()) * (self.x @ up.t())
                wgt = (top.values * (top.indices == j)).sum(-1, keepdim=True)
                out += wgt * (h @ down).float()
            return out
        s = t.cuda.Stream()
        s.wait_stream(t.cuda.current_stream())
        with t.cuda.stream(s):
            step()
        t.cuda.current_stream().wait_stream(s)
        self.graph = t.cuda.CUDAGraph()
        with t.cuda.graph(self.graph):
            self.out = step()
        self.graph.replay()
        t.cuda.synchronize()
        self.ref = self.out.clone()

    def check(self) -> dict[str, Any]:
        self.graph.replay()
        self.t.cuda.synchronize()
        rel = float((self.out - self.ref).norm() / self.ref.norm())
        return {"graph_ok": rel < LOGITS_TOL, "graph_equal": bool(self.t.equal(self.out, self.ref)), "graph_rel_err": rel}


def backend(device: str, seed: int, mix: str = "moe") -> Any:
    fp32 = mix == "moe-fp32"
    return CudaBackend(seed, fp32) if device == "cuda" else CpuBackend(seed, fp32)


# ------------------------------------------------------------------------------------ the child
def child_main(a: argparse.Namespace) -> None:
    """The expert-parallel worker: commands on stdin, one JSON answer a line on stdout; EOF ends it."""
    be = backend(a.device, a.seed, a.mix)
    shard = Shard(be, int(a.gb * (1 << 30)), a.seed, parent=False)
    out = sys.stdout
    out.write(json.dumps({"pid": os.getpid(), "size": be.used(shard.tensors), "experts": shard.experts,
                          "kv_blocks": shard.blocks}) + "\n")
    out.flush()
    for line in sys.stdin:
        words = line.split() or [""]
        if words[0] == "exit":
            break
        if words[0] == "verify":
            res = shard.verify()
        elif words[0] == "mutate":
            res = shard.mutate(float(words[1]))
        else:
            res = {"ok": False, "error": f"unknown command {words[0]!r}"}
        out.write(json.dumps(res) + "\n")
        out.flush()


class Child:
    """The parent's end of the pipe pair to its child."""

    def __init__(self, a: argparse.Namespace, gb: float) -> None:
        argv = [sys.executable, "-m", "scripts.workloads.moe_workload", "--child", "--gb", str(gb),
                "--seed", str(a.seed + 1), "--device", a.device, "--dir", a.dir, "--mix", a.mix]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"moe workload: the child exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=20)
    ap.add_argument("--mix", default="moe", help="moe-fp32: fp32 weights; anything else: bf16 (the default)")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--child-share", type=float, default=0.4, help="share of --gb the child holds")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_main(a)
        return
    child = Child(a, a.gb * a.child_share)
    be = backend(a.device, a.seed, a.mix)
    shard = Shard(be, int(a.gb * (1 - a.child_share) * (1 << 30)), a.seed, parent=True)
    graph = Graph(be, shard) if a.device == "cuda" and not a.no_graph else None
    if a.device == "cuda":
        be.torch.cuda.empty_cache()  # the footprint is the tensors and the graph, not set-up temporaries
    size = be.used(shard.tensors)
    announce(a.dir, {"pid": os.getpid(), "pids": [os.getpid(), child.info["pid"]], "size": size + child.info["size"],
                     "parent_size": size, "child": child.info, "experts": shard.experts + child.info["experts"],
                     "kv_blocks": shard.blocks, "graph": graph is not None, "device": a.device,
                     "mix": "moe-fp32" if be.fp32 else "moe",
                     "pinned_bytes": int(shard.pinned.nbytes) if shard.pinned is not None else 0})

    def handle(cmd: list[str]) -> dict[str, Any]:
        if cmd[0] == "verify":
            own = shard.verify()
            kid = child.ask("verify")
            out: dict[str, Any] = {"parent": own, "child": kid}
            ok = own["ok"] and kid["ok"]
            if graph is not None:
                g = graph.check()
                out.update(g)
                ok = ok and g["graph_ok"]
            out.update(ok=ok, tensors_equal=own["tensors_equal"] and kid["tensors_equal"])
            return out
        if cmd[0] == "mutate":
            pct = float(cmd[1])
            own, kid = shard.mutate(pct), child.ask(f"mutate {pct}")
            return {"ok": own["ok"] and kid["ok"], "blocks": own["blocks"] + kid["blocks"],
                    "bytes": own.get("bytes", 0) + kid.get("bytes", 0)}
        return {"ok": False, "error": f"unknown command {cmd[0]!r}"}

    try:
        serve(a.dir, handle, be.sync)
    finally:
        child.close()


if __name__ == "__main__":
    main()
