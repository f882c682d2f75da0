#!/usr/bin/env python3
"""bench_server.py's result as one figure: seconds to the first correct answer for each path (cold start,
baseline, gpusnap from NVMe / the warm tier, with and without hooks, in place), each bar beside its
floor (stored bytes at the cold read rate + the driver's restore) where it has one, and the issue's
targets as lines (0.5x the baseline; 0.2x and 0.1x the cold start).

Usage: python3 -m scripts.bench.plot_server SERVER.json OUT.png   (needs matplotlib: pip install '.[plot]')
"""
from __future__ import annotations

import json
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(sys.argv[1]) as f:
        d = json.load(f)
    rows = d.get("ratios") or []
    if not rows:
        print("no rows in the result", file=sys.stderr)
        return 1
    names = [r["what"] for r in rows]
    secs = [r["answer_s"] for r in rows]
    floors = [r.get("floor_s") or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], secs, height=0.4, label="first correct answer", color="#3b6ea5")
    ax.barh([i - 0.2 for i in y], floors, height=0.4, label="floor (stored bytes / cold read + driver restore)",
            color="#b0b0b0")
    for i, s in enumerate(secs):
        ax.text(s, i + 0.2, f" {s:.1f} s", va="center", fontsize=8)
    cold = next((r["answer_s"] for r in rows if r["what"] == "cold start"), None)
    base = next((r["answer_s"] for r in rows if "baseline" in r["what"]), None)
    for x, label, style in ((base * 0.5 if base else None, "0.5x baseline", "--"),
                            (cold * 0.2 if cold else None, "0.2x cold", ":"),
                            (cold * 0.1 if cold else None, "0.1x cold", "-.")):
        if x:
            ax.axvline(x, color="#c0392b", linestyle=style, linewidth=1, label=label)
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from start to the first correct HTTP answer")
    a = d.get("args") or {}
    ax.set_title(f"transformers server, {a.get('gb')} GB weights + {a.get('kv_gb')} GB KV pool ({a.get('device')})",
                 fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
