#!/usr/bin/env python3
"""A CUDA process holding N GB of known data, for GPU tests and benchmarks.

The memory is one cuMemAlloc block (so a CUDA IPC handle covers it exactly), filled
(64 MiB blocks, 20-block period) by a deterministic recipe: `realistic` = 40% bf16 values from N(0, 0.02) (weights), 5% random bytes,
55% zeros (an idle KV-cache pool); `pessimistic` = half random, half zeros; `random`; `zeros`.
It regenerates any block from its seed to verify itself, so a restore is checked against the recipe,
not against a copy that went through the same path.

Control through files in --dir (a fresh directory per run): it writes `ready` (JSON: pid, size, IPC
handle); then it polls for `cmd` (one line), executes it and writes `cmd.done` (JSON result).
Commands: verify | clear | mutate PERCENT | exit.
"""
from __future__ import annotations

import argparse
import ctypes
import os

import torch
from cuda.bindings import driver as d

from scripts.workloads.command_loop import announce, serve

BLOCK = 64 << 20


def ck(out):
    err = out[0] if isinstance(out, tuple) else out
    if int(err) != 0:
        raise SystemExit(f"workload: CUDA error {err}")
    return out[1] if isinstance(out, tuple) and len(out) == 2 else None


def kind(mix: str, i: int) -> str:
    if mix == "realistic":
        r = i % 20
        return "bf16" if r < 8 else ("random" if r == 8 else "zeros")
    if mix == "pessimistic":
        return "random" if i % 2 == 0 else "zeros"
    return mix


def fill(t: torch.Tensor, k: str, seed: int) -> None:
    g = torch.Generator(device=t.device).manual_seed(seed)
    if k == "zeros":
        t.zero_()
    elif k == "random":
        t.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, (t.numel() // 4,), generator=g,
                                                device=t.device, dtype=torch.int32))
    elif k == "bf16":
        t.view(torch.bfloat16).copy_(torch.randn(t.numel() // 2, generator=g, device=t.device) * 0.02)
    else:
        raise SystemExit(f"unknown mix {k}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4)
    ap.add_argument("--mix", default="realistic")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # make the primary context current
    size = int(a.gb * (1 << 30)) // BLOCK * BLOCK
    ptr = int(ck(d.cuMemAlloc(size)))

    class Cai:
        __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}

    mem = torch.as_tensor(Cai(), device="cuda")
    seeds = [a.seed * 100003 + i for i in range(size // BLOCK)]
    kinds = [kind(a.mix, i) for i in range(len(seeds))]
    for i, s in enumerate(seeds):
        fill(mem[i * BLOCK:(i + 1) * BLOCK], kinds[i], s)
    torch.cuda.synchronize()
    handle = ck(d.cuIpcGetMemHandle(ptr))
    ipc = ctypes.string_at(handle.getPtr(), 64)  # CUipcMemHandle is 64 opaque bytes
    announce(a.dir, {"pid": os.getpid(), "size": size, "ipc": ipc.hex(), "mix": a.mix})

    def handle(cmd: list[str]) -> dict:
        if cmd[0] == "verify":
            bad = []
            scratch = torch.empty(BLOCK, dtype=torch.uint8, device="cuda")
            for i, s in enumerate(seeds):
                fill(scratch, kinds[i], s)
                if not torch.equal(scratch, mem[i * BLOCK:(i + 1) * BLOCK]):
                    bad.append(i)
            del scratch
            return {"ok": not bad, "bad_blocks": bad[:20]}
        if cmd[0] == "clear":
            mem.fill_(0xA5)
            return {"ok": True}
        if cmd[0] == "mutate":
            pct = float(cmd[1])
            nblk = max(1, round(len(seeds) * pct / 100))
            start = len(seeds) // 3
            for i in range(start, start + nblk):  # rewrite a contiguous 5%: new seeds, random data
                seeds[i] = seeds[i] + 7_777_777
                kinds[i] = "random"
                fill(mem[i * BLOCK:(i + 1) * BLOCK], "random", seeds[i])
            return {"ok": True, "blocks": nblk}
        return {"ok": False, "error": f"unknown command {cmd[0]!r}"}

    serve(a.dir, handle, torch.cuda.synchronize)


if __name__ == "__main__":
    main()
