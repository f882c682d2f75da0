#!/usr/bin/env python3
"""Every recorded H200 e2e run's cold restore against the disk it met: x, the disk's cold read rate
measured in that run (the better of one and four readers); y, the rate the restore read the store at
(stored bytes over its CRIU and fill phases) and, beside it, the restore's time over its floor.
A restore whose reads kept up with the disk lies on the diagonal.

Usage: python3 -m scripts.bench.plot_restore_floor OUT.png [results/*-h200/*/e2e-*.json ...]
(needs matplotlib: pip install '.[plot]')."""
from __future__ import annotations

import glob
import os
import json
import sys


RECENT = os.environ.get("RECENT", "2026-12-04")  # filled markers: runs in results/ folders of this date (the newest code); hollow: older


def points(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        try:
            d = json.load(open(p))
        except (OSError, ValueError):
            continue
        disk = d.get("disk_floor")
        for path in d.get("paths", []):
            g, r = d.get(f"gpusnap_{path}"), (d.get("rates") or {}).get(f"gpusnap_{path}")
            st = (g or {}).get("restore_stages") or {}
            if not disk or not g or not r or "split_fill" not in st:
                continue
            reading = st.get("criu_restore", 0.0) + st["split_fill"]
            out.append({"file": p, "workload": d.get("workload", "?"), "gb": d.get("gb"),
                        "disk": max(disk["read1_gbps"], disk["read4_gbps"]),
                        "read": g["stored_bytes"] / reading / 1e9, "over": r["restore_over_floor"]})
    return out


def main() -> None:
    out = sys.argv[1]
    paths = sys.argv[2:] or sorted(glob.glob("results/*-h200/*/e2e-*.json"))
    pts = points(paths)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    marks = {"moe": ("o", "tab:blue"), "serving": ("s", "tab:orange"), "synthetic": ("^", "tab:gray")}
    for p in pts:
        m, c = marks.get(p["workload"], ("x", "k"))
        recent = RECENT in p["file"]
        kw = dict(marker=m, s=14 + (p["gb"] or 20), color=c if recent else "none", edgecolors=c)
        a.scatter(p["disk"], p["read"], **kw)
        b.scatter(p["disk"], p["over"], **kw)
    lo, hi = 1.0, 2.5
    a.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="reads at the disk's rate")
    a.set_xlabel("disk cold read, same run (GB/s)")
    a.set_ylabel("restore's reads: stored GB / (CRIU + fill) s")
    a.set_xlim(lo, hi)
    a.set_ylim(0.6, hi)
    b.axhline(1.25, color="k", ls="--", lw=0.8, label="target 1.25x")
    b.set_xlabel("disk cold read, same run (GB/s)")
    b.set_ylabel("cold restore / its floor")
    b.set_xlim(lo, hi)
    for k, (m, c) in marks.items():
        b.scatter([], [], marker=m, color=c, label=k)
    a.legend(loc="upper left", fontsize=8)
    b.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"H200 restores, {len(pts)} runs (size: GB of GPU memory; filled: {RECENT}, hollow: older code)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"{out}: {len(pts)} runs")


if __name__ == "__main__":
    main()
