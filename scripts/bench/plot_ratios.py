#!/usr/bin/env python3
"""Draw BENCHMARKS.md section 24's figure from recorded runs of scripts/bench/bench_e2e.py: per run,
gpusnap's cold restore against the baseline's (same run) and against its floor (the stored bytes at
the disk's cold read rate measured in that run, plus the driver's restore), its durable dump against
the baseline's, and the disk's read rate that hour (the baseline CRIU restore's own rate), with the
targets of issue 21 drawn across.
Usage: python3 -m scripts.bench.plot_ratios OUT.png LABEL=E2E.json...  (needs matplotlib)"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from scripts.bench.bench_e2e import rates  # noqa: E402


def figures(path: str) -> dict[str, float]:
    d = json.load(open(path))
    b, g = d["baseline"], d["gpusnap_stream"]
    r = d.get("rates") or rates(d)
    return {"restore": g["restore"] / b["restore"], "floor": r["gpusnap_stream"]["restore_over_floor"],
            "dump": g["dump"] / b["dump"], "disk": b["image_bytes"] / b["criu_restore"] / 1e9,
            "moe": d.get("workload") == "moe"}


def main() -> None:
    out, runs = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
    figs = [(label, figures(path)) for label, path in runs]
    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    x = range(len(figs))
    colours = ["tab:blue" if f["moe"] else "tab:orange" for _, f in figs]
    for ax, key, target, title in ((axes[0], "restore", 0.6, "cold restore / baseline (target <= 0.6)"),
                                   (axes[1], "floor", 1.25, "cold restore / its floor (target <= 1.25)"),
                                   (axes[2], "dump", 0.7, "durable dump / baseline (target <= 0.7)"),
                                   (axes[3], "disk", None, "that hour's disk: baseline CRIU restore read, GB/s")):
        ax.bar(x, [f[key] for _, f in figs], color=colours)
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=9, loc="left")
        for i, (_, f) in enumerate(figs):
            ax.text(i, f[key], f"{f[key]:.2f}", ha="center", va="bottom", fontsize=7)
    axes[-1].set_xticks(list(x))
    axes[-1].set_xticklabels([label for label, _ in figs], rotation=30, ha="right", fontsize=8)
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="tab:blue"),
                            plt.Rectangle((0, 0), 1, 1, color="tab:orange")],
                   labels=["MoE-like tree (weights)", "serving (zero-heavy)"], fontsize=8, loc="upper right", ncol=2,
                   bbox_to_anchor=(1.0, 0.96))
    fig.suptitle("baseline and gpusnap in the same run each time (issue 21); H200 unless the label names another card",
                 fontsize=10, x=0.4)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
