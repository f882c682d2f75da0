#!/usr/bin/env python3
"""Draw what the machine did during cold restores recorded by scripts/bench/bench_e2e.py (its timelines):
busy cores and the disk's read rate over time, one panel per restore, the restore's own phases
shaded (startup, plan, CRIU, the split fill, the driver's restore after it), the disk's cold-read floor
drawn, and each CUDA process's driver copy where it started early (beside the fill).

Usage: python3 -m scripts.bench.plot_timeline OUT.png E2E.json[:LABEL[:VARIANT]]...
VARIANT: "" (the first cold restore) or the index of a --restore-variant (0, 1, ...)."""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASE_COLORS = {"startup": "#dddddd", "load": "#d4d4d4", "plan": "#bbbbbb", "plan:split": "#aaaaaa", "plan:fill-start": "#999999",
                "plan:rest": "#bbbbbb", "prepare": "#cccccc", "prepare:gpu": "#c4c4c4", "prepare:rest": "#cccccc", "plan:serve": "#bbbbbb", "criu": "#f2c49b", "fill": "#b7dfb9",
                "between": "#ffffff", "gpu": "#a9c4e8", "exit": "#eeeeee"}


def restore_of(run: dict, variant: str) -> tuple[dict, dict, str, dict]:
    g = run["gpusnap_stream"]
    r = g if variant == "" else g["restore_variants"][int(variant)]
    env = "" if variant == "" else ",".join(f"{k}={v}" for k, v in r["env"].items())
    return r["restore_timeline"], r["restore_phases"], env, r.get("restore_early_gpu") or {}


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    fig, axes = plt.subplots(len(specs), 1, figsize=(10, 2.6 * len(specs)), squeeze=False)
    for ax, spec in zip(axes[:, 0], specs):
        path, _, rest = spec.partition(":")
        label, _, variant = rest.partition(":")
        with open(path) as f:
            run = json.load(f)
        tl, phases, env, early = restore_of(run, variant)
        rows = tl["rows"]
        t = [r[0] for r in rows]
        t0 = 0.0
        for name, ph in phases.items():
            ax.axvspan(t0, t0 + ph["seconds"], color=PHASE_COLORS.get(name, "#ffffff"), alpha=0.8, lw=0)
            if ph["seconds"] > 0.6:
                ax.text(t0 + ph["seconds"] / 2, tl["ncpu"] * 0.97, name, ha="center", va="top", fontsize=8)
            t0 += ph["seconds"]
        copies = early.get("copy_s") or {}
        for i, (mark, at) in enumerate(sorted((early.get("filled_at_s") or {}).items(), key=lambda kv: kv[1])):
            pid = mark.partition("_")[2]  # each CUDA process's driver copy, from when its memory was in
            took = float(copies.get(pid, 0.0))
            y = tl["ncpu"] * (0.80 - 0.08 * i)
            ax.plot([at, at + took], [y, y], color="#1f4e99", lw=3, solid_capstyle="butt",
                    label="a process's GPU copy (early)" if i == 0 else None)
            ax.text(at + took, y, f" pid {pid}: {took:.1f} s", va="center", fontsize=7, color="#1f4e99")
        ax.plot(t, [r[1] for r in rows], color="#333333", lw=1.2, label="busy cores")
        ax.set_ylim(0, tl["ncpu"])
        ax.set_ylabel("cores")
        ax2 = ax.twinx()
        ax2.plot(t, [r[3] for r in rows], color="#c44e52", lw=1.2, label="disk read GB/s")
        floor = max(run["disk_floor"]["read1_gbps"], run["disk_floor"]["read4_gbps"])
        ax2.axhline(floor, color="#c44e52", ls="--", lw=0.8)
        ax2.set_ylim(0, max(2.5, floor * 1.3))
        ax2.set_ylabel("GB/s")
        g = run["gpusnap_stream"]
        total = t0
        base = run.get("baseline", {}).get("restore")
        ax.set_title(f"{label}{' (' + env + ')' if env else ''}: restore {total:.1f} s"
                     + (f" = {total / base:.2f}x the baseline's {base:.1f} s" if base else "")
                     + f"; {g['stored_bytes'] / 1e9:.1f} GB stored; disk floor {floor:.2f} GB/s (dashed)", fontsize=9)
        ax.set_xlim(0, max(t[-1] if t else 1, total))
        if ax is axes[0, 0]:
            lines = [ln for ln in ax.get_lines() + ax2.get_lines()[:1] if not ln.get_label().startswith("_")]
            ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds from the start of `gpusnap criu restore`")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
