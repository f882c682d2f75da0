#!/usr/bin/env python3
"""How often a restore's disk completed no read at all in a sample, from recorded bench_e2e runs: per
run, the split fill's active samples (iowait above one core or reading), how many of them read nothing,
their mean read rate, and the same count for the baseline's CRIU restore (BENCHMARKS.md section 41);
where the timeline has the disk_busy column (since 2026-12-06, section 42), how many of those samples
found the disk idle as well.
Usage: python3 -m scripts.bench.fill_stalls E2E.json..."""
from __future__ import annotations

import json
import sys
from typing import Any


def stalls(timeline: dict[str, Any], waiting: float) -> tuple[int, int, float]:
    """(active samples, of them reading nothing, mean read GB/s over the active ones) of a recorded
    TIMELINE (scripts/bench/timeline.py's as_json: its columns name the rows' fields); a sample is
    active when more than WAITING cores wait on I/O or the disk read anything."""
    rows, columns = timeline.get("rows") or [], timeline.get("columns") or []
    if not rows:
        return 0, 0, 0.0
    iowait, read = columns.index("iowait_cores"), columns.index("read_gbps")
    active = [r for r in rows if r[iowait] > waiting or r[read] > 0.05]
    idle = [r for r in active if r[read] == 0.0]
    return len(active), len(idle), (sum(r[read] for r in active) / len(active) if active else 0.0)


IDLE_DISK = 0.5  # a sample is a true stall when the disk had a request in flight for less than half of it


def idle_disk(timeline: dict[str, Any], waiting: float) -> int | None:
    """Of the active samples that read nothing, how many found the disk idle too (a request in flight
    for under IDLE_DISK of the sample): a read counts when it completes, so a sample inside a long
    read reads nothing while the disk works. None for a timeline recorded without the disk_busy column."""
    rows, columns = timeline.get("rows") or [], timeline.get("columns") or []
    if "disk_busy" not in columns:
        return None
    iowait, read, busy = columns.index("iowait_cores"), columns.index("read_gbps"), columns.index("disk_busy")
    return sum(1 for r in rows if (r[iowait] > waiting or r[read] > 0.05) and r[read] == 0.0 and r[busy] < IDLE_DISK)


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            d: dict[str, Any] = json.load(f)
        fill = (d.get("gpusnap_stream") or {}).get("restore_timeline") or {}
        base = (d.get("baseline") or {}).get("criu_restore_timeline") or {}
        n, z, mean = stalls(fill, 1.0)
        bn, bz, bmean = stalls(base, 0.3)  # a lower bar: its one reader keeps few cores waiting
        if not n:
            continue
        idle = idle_disk(fill, 1.0)
        print(f"{path}: fill {z}/{n} samples read nothing ({100 * z / n:.1f}%"
              + ("" if idle is None else f", {idle} with the disk idle") + f"), mean {mean:.2f} GB/s"
              + (f" | baseline {bz}/{bn}, mean {bmean:.2f} GB/s" if bn else " | no baseline timeline"))


if __name__ == "__main__":
    main(sys.argv[1:])
