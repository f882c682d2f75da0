#!/usr/bin/env python3
"""Draw BENCHMARKS.md section 14's figure from recorded runs of scripts/bench/bench_e2e.py: per run,
the durable dump and the cold restore of the baseline (driver + plain CRIU + sync) and of gpusnap
(its stages stacked), with gpusnap's floor (stored bytes at the disk's measured rate + the driver's
own step) as a tick, so each bar reads against what the disk allows.
Usage: python3 -m scripts.bench.plot_hostpath OUT.png E2E.json...  (needs matplotlib)"""
from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"driver": "#4c72b0", "CRIU": "#dd8452", "split fill": "#55a868", "rest": "#bbbbbb"}


def bars(run: dict) -> list[tuple[str, list[tuple[str, float]], float | None]]:
    b, g, r = run["baseline"], run["gpusnap_stream"], run["rates"]["gpusnap_stream"]
    gd, gr = g["dump_stages"], g["restore_stages"]
    rest_d = g["dump"] - gd["gpu_checkpoint"] - gd["dump+ingest"]
    rest_r = g["restore"] - gr["criu_restore"] - gr["split_fill"] - gr["gpu_restore"]
    return [
        ("baseline\ndump", [("driver", b["driver_lock+checkpoint"]), ("CRIU", b["criu_dump+sync"])], None),
        ("gpusnap\ndump", [("driver", gd["gpu_checkpoint"]), ("CRIU", gd["dump+ingest"]), ("rest", rest_d)],
         r["dump_floor_s"]),
        ("baseline\nrestore", [("CRIU", b["criu_restore"]), ("driver", b["driver_restore+unlock"])], None),
        ("gpusnap\nrestore", [("CRIU", gr["criu_restore"]), ("split fill", gr["split_fill"]),
                              ("driver", gr["gpu_restore"]), ("rest", rest_r)], r["restore_floor_s"]),
    ]


def main() -> None:
    out, paths = sys.argv[1], sys.argv[2:]
    runs = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 4.2), sharey=True)
    axes = axes if len(runs) > 1 else [axes]
    seen: set[str] = set()
    for ax, run in zip(axes, runs):
        for x, (label, parts, floor) in enumerate(bars(run)):
            bottom = 0.0
            for name, v in parts:
                ax.bar(x, v, bottom=bottom, color=COLORS[name], label=None if name in seen else name, width=0.7)
                seen.add(name)
                bottom += v
            ax.text(x, bottom + 0.5, f"{bottom:.1f} s", ha="center", fontsize=8)
            if floor is not None:
                ax.hlines(floor, x - 0.4, x + 0.4, colors="black", linestyles="dashed",
                          label=None if "floor" in seen else "gpusnap's floor")
                seen.add("floor")
        g, b = run["gpusnap_stream"], run["baseline"]
        ax.set_title(f"{run['workload']} {run['gb']:.0f} GB: dump {g['dump'] / b['dump']:.2f}x, "
                     f"restore {g['restore'] / b['restore']:.2f}x", fontsize=9)
        ax.set_xticks(range(4), [lbl for lbl, _, _ in bars(run)], fontsize=8)
    axes[0].set_ylabel("seconds (H200, CRIU 4.2.1 both sides)")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"host-staged path vs driver + plain CRIU, {runs[0]['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} from {', '.join(os.path.basename(p) for p in paths)}")


if __name__ == "__main__":
    main()
