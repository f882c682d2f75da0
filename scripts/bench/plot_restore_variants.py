#!/usr/bin/env python3
"""The restores of one bench_e2e run (the default, then each --restore-variant, all of one snapshot)
as stacked bars of their stages: CRIU's part, the split fill after it, the driver's restore, the rest;
with the run's floor (stored bytes at the disk's cold read rate + the driver's restore) as a line, and
under each bar the seconds CRIU's own log spent in pauses of 20 ms or more (--criu-logs).

Usage: python3 -m scripts.bench.plot_restore_variants OUT.png LABEL=results/.../e2e-speed-20.json ...
(one panel per file; needs matplotlib: pip install '.[plot]')."""
from __future__ import annotations

import json
import sys
from typing import Any


def restores(path: str) -> tuple[list[dict[str, Any]], float | None]:
    """Each restore of PATH's first gpusnap path: name, stages (s), CRIU's pauses (s); and the floor (s)."""
    d = json.load(open(path))
    g = next(d[k] for k in d if k.startswith("gpusnap_") and isinstance(d[k], dict) and "restore" in d[k])
    floor = None
    disk = d.get("disk_floor") or {}
    rate = max(disk.get("read1_gbps", 0), disk.get("read4_gbps", 0))
    out = []
    for name, r in [("default", g)] + [(",".join(f"{k.removeprefix('GPUSNAP_')}={v}" for k, v in v["env"].items()), v)
                                       for v in g.get("restore_variants", [])]:
        st = r.get("restore_stages") or {}
        parts = {"CRIU": st.get("criu_restore", 0.0), "fill": st.get("split_fill", 0.0), "driver": st.get("gpu_restore", 0.0)}
        parts["rest"] = max(0.0, r["restore"] - sum(parts.values()))
        waits = ((r.get("restore_waits") or {}).get("criu_log") or {}).get("waits") or {}
        out.append({"name": name, "parts": parts, "pauses": sum(w["seconds"] for w in waits.values())})
        if floor is None and rate and g.get("stored_bytes"):
            floor = g["stored_bytes"] / 1e9 / rate + st.get("gpu_restore", 0.0)
    return out, floor


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [a.split("=", 1) if "=" in a else (a, a) for a in argv[1:]]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.8), squeeze=False)
    colors = {"CRIU": "#c44e52", "fill": "#4c72b0", "driver": "#55a868", "rest": "#bbbbbb"}
    for ax, (label, path) in zip(axes[0], runs):
        rs, floor = restores(path)
        for i, r in enumerate(rs):
            bottom = 0.0
            for k, v in r["parts"].items():
                ax.bar(i, v, bottom=bottom, color=colors[k], label=k if i == 0 else None)
                bottom += v
            ax.text(i, bottom + 0.1, f"{bottom:.2f}", ha="center", fontsize=8)
        if floor:
            ax.axhline(floor, color="black", ls="--", lw=1, label=f"floor {floor:.2f} s")
            ax.axhline(floor * 1.25, color="black", ls=":", lw=1, label="1.25x floor")
        ax.set_xticks(range(len(rs)), [f"{r['name']}\npauses {r['pauses']:.1f} s" for r in rs], fontsize=7, rotation=20)
        ax.set_ylabel("cold restore, s")
        ax.set_title(label, fontsize=10)
        ax.set_ylim(0, 1.35 * max(sum(r["parts"].values()) for r in rs))
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
