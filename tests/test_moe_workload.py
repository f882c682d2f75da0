"""The MoE-like benchmark workload (scripts/workloads/moe_workload.py) without a GPU (--device cpu:
numpy arrays in place of device memory): it starts its child as a second process of its tree,
answers the control protocol the benchmarks drive, verifies both processes' memory bit for bit, finds
a changed byte in either (the checksums it keeps must be able to fail), mutates the KV pools and ends
its child on `exit`."""
from __future__ import annotations

import os
import time

from scripts.workloads.workload_control import Workload
from sandbox.host.processes import process_tree


def _poke(pid: int) -> None:
    """Flip one byte in the middle of PID's first large anonymous mapping (through /proc/PID/mem): in
    these processes that is array memory (numpy maps every large array on its own)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for line in maps:
            f = line.split()
            if len(f) > 5 or "rw" not in f[1]:
                continue
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            if hi - lo < (16 << 20):
                continue
            mem.seek(lo + (hi - lo) // 2)
            b = mem.read(1)
            mem.seek(lo + (hi - lo) // 2)
            mem.write(bytes([b[0] ^ 0x10]))
            return
    raise AssertionError(f"no large anonymous mapping in {pid}")


def test_moe_workload_tree_protocol_and_self_check() -> None:
    with Workload(0.3, detached=True, script="moe_workload.py", extra=("--device", "cpu"), timeout=120) as w:
        info = w.info
        assert info["mix"] == "moe" and info["device"] == "cpu" and len(w.pids) == 2
        parent, child = w.pids
        assert process_tree(parent) == [parent, child]
        assert info["size"] > 0.25 * (1 << 30) and info["experts"] >= 2
        first = w.cmd("verify")
        assert first["ok"] and first["parent"]["ok"] and first["child"]["ok"], first
        m = w.cmd("mutate 5")
        assert m["ok"] and m["blocks"] > 0, m
        assert w.cmd("verify")["ok"]
        assert w.cmd("nonsense")["ok"] is False
        for pid in (child, parent):  # a flipped byte in either process is found
            _poke(pid)
            bad = w.cmd("verify")
            assert not bad["ok"], bad
            side = "parent" if pid == parent else "child"
            assert not bad[side]["tensors_equal"] and bad[side]["bad_tensors"], bad
            w.cmd("mutate 1")  # re-records the checksums: verified again from here
            assert w.cmd("verify")["ok"]
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{p}") for p in (parent, child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in (parent, child):
        try:
            st = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        assert st == "Z", f"{p} still running after exit"
