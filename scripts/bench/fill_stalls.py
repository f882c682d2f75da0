#!/usr/bin/env python3
"""How often a restore's disk completed no read at all in a sample, from recorded bench_e2e runs: per
run, the split fill's active samples (iowait above one core or reading), how many of them read nothing,
their mean read rate, and the same count for the baseline's CRIU restore (BENCHMARKS.md section 41).
Usage: python3 -m scripts.bench.fill_stalls E2E.json..."""
from __future__ import annotations

import json
import sys
from typing import Any

T, BUSY, IOWAIT, READ = 0, 1, 2, 3  # the timeline's columns (scripts/bench/timeline.py)


def stalls(rows: list[list[float]], waiting: float) -> tuple[int, int, float]:
    """(active samples, of them reading nothing, mean read GB/s over the active ones); a sample is
    active when more than WAITING cores wait on I/O or the disk read anything."""
    active = [r for r in rows if r[IOWAIT] > waiting or r[READ] > 0.05]
    idle = [r for r in active if r[READ] == 0.0]
    return len(active), len(idle), (sum(r[READ] for r in active) / len(active) if active else 0.0)


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            d: dict[str, Any] = json.load(f)
        fill = ((d.get("gpusnap_stream") or {}).get("restore_timeline") or {}).get("rows") or []
        base = ((d.get("baseline") or {}).get("criu_restore_timeline") or {}).get("rows") or []
        n, z, mean = stalls(fill, 1.0)
        bn, bz, bmean = stalls(base, 0.3)
        if not n:
            continue
        print(f"{path}: fill {z}/{n} samples read nothing ({100 * z / n:.1f}%), mean {mean:.2f} GB/s"
              + (f" | baseline {bz}/{bn}, mean {bmean:.2f} GB/s" if bn else " | no baseline timeline"))


if __name__ == "__main__":
    main(sys.argv[1:])
