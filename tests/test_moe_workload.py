"""The MoE-like benchmark workload (scripts/workloads/moe_workload.py) without a GPU (--device cpu:
numpy arrays in place of device memory): it starts its child as a second process of its tree,
answers the control protocol the benchmarks drive, verifies both processes' memory bit for bit, finds
a changed byte in either (the checksums it keeps must be able to fail), mutates the KV pools and ends
its child on `exit`."""
from __future__ import annotations

import os
import time
from pathlib import Path

from conftest import Cli
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


def test_an_fp32_tree_is_stored_as_four_byte_planes_and_restored(cli: Cli, store_dir: Path) -> None:
    """`--mix moe-fp32` (weights in fp32, as a model loaded without a dtype holds them): the tree
    checks itself, `criu dump` stores its weights' pages as shuffle4-zstd chunks, fewer bytes than
    zstd alone would keep, and `criu restore` brings both processes back bit for bit."""
    import json
    from support.criu import require_criu
    require_criu()
    with Workload(0.3, detached=True, script="moe_workload.py", extra=("--device", "cpu", "--mix", "moe-fp32"),
                  timeout=120) as w:
        assert w.info["mix"] == "moe-fp32" and len(w.pids) == 2
        assert w.cmd("verify")["ok"]
        dump = cli.json("criu", "dump", str(w.pid), "fp32")
        w.reap()
        man = json.loads((store_dir / "snapshots" / "fp32.json").read_text())
        chunks = [c for s in man["streams"] if "pages-" in s["name"] for c in s["chunks"]]
        by_codec: dict[str, int] = {}
        for c in chunks:
            by_codec[c[2]] = by_codec.get(c[2], 0) + 1
        assert by_codec.get("shuffle4-zstd", 0) > by_codec.get("zstd", 0), (by_codec, dump)
        cli.run("criu", "restore", "fp32")
        after = w.cmd("verify")
        assert after["ok"] and after["parent"]["ok"] and after["child"]["ok"], after
