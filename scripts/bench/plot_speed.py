#!/usr/bin/env python3
"""Draw the host-staged speed figure (issue 17) from recorded H200 runs of scripts/bench/bench_e2e.py.

Left: the last run's stages, baseline (driver + plain CRIU + sync) against gpusnap's stream path with
the split restore, dump and cold restore. Right: every run's cold restore as a ratio of its own
baseline's, and its floor (CRIU restoring the image from memory with THP + the driver's restore),
so the runs on different machine instances compare.
Usage: python3 -m scripts.bench.plot_speed OUT.png RUN_DIR... (each holding e2e-speed-20.json)."""
from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"driver": "#4c72b0", "CRIU": "#dd8452", "ingest tail": "#c44e52", "split fill": "#55a868",
          "fixed": "#bbbbbb", "sync": "#8c8c8c"}


def stages(run: dict) -> list[tuple[str, list[tuple[str, float]]]]:
    b, g = run["baseline"], run["gpusnap_stream"]
    gd, gr = g["dump_stages"], g["restore_stages"]
    return [
        ("baseline dump", [("driver", b["driver_lock+checkpoint"]), ("CRIU", b["criu_dump+sync"])]),
        ("gpusnap dump", [("driver", gd["gpu_checkpoint"]), ("CRIU", gd["dump+ingest"]), ("fixed", g["fixed_dump"])]),
        ("baseline restore", [("CRIU", b["criu_restore"]), ("driver", b["driver_restore+unlock"])]),
        ("gpusnap restore", [("CRIU", gr["criu_restore"]), ("split fill", gr.get("split_fill", 0.0)),
                             ("driver", gr["gpu_restore"]), ("fixed", g["fixed_restore"])]),
        ("floor (restore)", [("CRIU", b["floor_warm_thp"]["criu_restore"]),
                             ("driver", b["floor_warm_thp"]["driver_restore+unlock"])]),
    ]


def main() -> None:
    out, dirs = sys.argv[1], sys.argv[2:]
    runs = [(os.path.basename(d.rstrip("/")), json.load(open(os.path.join(d, "e2e-speed-20.json")))) for d in dirs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.4), gridspec_kw={"width_ratios": [3, 2]})
    name, last = runs[-1]
    seen: set[str] = set()
    rows = stages(last)
    for i, (label, parts) in enumerate(rows):
        left = 0.0
        for part, sec in parts:
            ax1.barh(i, sec, left=left, color=COLORS[part], label=None if part in seen else part)
            seen.add(part)
            left += sec
        ax1.text(left + 0.3, i, f"{left:.1f} s", va="center")
    ax1.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax1.invert_yaxis()
    ax1.set_xlabel("seconds")
    ax1.set_title(f"20 GB model-serving process, H200, {last['date']} ({name})")
    ax1.legend(loc="lower right")
    labels, restore, floor = [], [], []
    for name, r in runs:
        b, g = r["baseline"], r["gpusnap_stream"]
        short = "-".join(name.split("-")[:2])
        labels.append(short + ("\nsplit" if "split_fill" in g["restore_stages"] else "\nCRIU restores all"))
        restore.append(g["restore"] / b["restore"])
        floor.append(b["floor_warm_thp"]["restore"] / b["restore"])
    x = range(len(runs))
    ax2.bar([i - 0.2 for i in x], restore, 0.4, label="gpusnap cold restore", color="#55a868")
    ax2.bar([i + 0.2 for i in x], floor, 0.4, label="floor", color="#bbbbbb")
    ax2.axhline(1.0, color="black", lw=0.8)
    ax2.axhline(0.8, color="#c44e52", ls="--", lw=1, label="target 0.8x")
    for i, v in enumerate(restore):
        ax2.text(i - 0.2, v + 0.02, f"{v:.2f}", ha="center")
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_ylabel("time / the same run's baseline restore")
    ax2.set_title("cold restore, run by run")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
