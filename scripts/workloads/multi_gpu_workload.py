#!/usr/bin/env python3
"""A CUDA process holding --gb GB of known data on EVERY GPU it sees (one process spanning GPUs), for
the two-GPU tests and scripts/device/two_gpu.py.

Each GPU's block is filled by gpu_workload.py's recipe with seeds of its own (GPU i: seed*1000+i), so
`verify` regenerates every block on the GPU that holds it and compares: a restore onto other GPUs is
checked against the recipe, not against a copy. Same file protocol as gpu_workload.py (command_loop):
`ready` is {pid, size (bytes per GPU), gpus, uuids}; commands verify | clear | where | exit. `where`
answers the UUID of each logical device as the process sees it now (after a restore onto other
GPUs, the new ones, if the driver reports them so).
"""
from __future__ import annotations

import argparse
import os

import torch

from scripts.workloads.command_loop import announce, serve
from scripts.workloads.gpu_workload import BLOCK, fill, kind


def uuids() -> list[str]:
    out = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    return [u if u.startswith("GPU-") else f"GPU-{u}" for u in out]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2, help="GB on each GPU")
    ap.add_argument("--mix", default="realistic")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    n = torch.cuda.device_count()
    if n < 1:
        raise SystemExit("multi_gpu_workload: no GPU")
    size = int(a.gb * (1 << 30)) // BLOCK * BLOCK
    mems, seeds, kinds = [], [], []
    for g in range(n):
        with torch.cuda.device(g):
            mem = torch.empty(size, dtype=torch.uint8, device=f"cuda:{g}")
            s = [(a.seed * 1000 + g) * 100003 + i for i in range(size // BLOCK)]
            k = [kind(a.mix, i) for i in range(len(s))]
            for i in range(len(s)):
                fill(mem[i * BLOCK:(i + 1) * BLOCK], k[i], s[i])
            torch.cuda.synchronize(g)
        mems.append(mem)
        seeds.append(s)
        kinds.append(k)
    announce(a.dir, {"pid": os.getpid(), "size": size, "gpus": n, "uuids": uuids(), "mix": a.mix})

    def sync() -> None:
        for g in range(n):
            torch.cuda.synchronize(g)

    def handle(cmd: list[str]) -> dict:
        if cmd[0] == "verify":
            bad: dict[str, list[int]] = {}
            for g in range(n):
                with torch.cuda.device(g):
                    scratch = torch.empty(BLOCK, dtype=torch.uint8, device=f"cuda:{g}")
                    for i, s in enumerate(seeds[g]):
                        fill(scratch, kinds[g][i], s)
                        if not torch.equal(scratch, mems[g][i * BLOCK:(i + 1) * BLOCK]):
                            bad.setdefault(str(g), []).append(i)
                    del scratch
            return {"ok": not bad, "bad_blocks": {g: b[:20] for g, b in bad.items()}}
        if cmd[0] == "clear":
            for m in mems:
                m.fill_(0xA5)
            return {"ok": True}
        if cmd[0] == "where":
            return {"ok": True, "uuids": uuids()}
        return {"ok": False, "error": f"unknown command {cmd[0]!r}"}

    serve(a.dir, handle, sync)


if __name__ == "__main__":
    main()
