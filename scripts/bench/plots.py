#!/usr/bin/env python3
"""The figures of BENCHMARKS.md, one subcommand each, drawn from the JSON the benchmarks record
(matplotlib needed; imported only when a figure is drawn).

  ratios OUT.png LABEL=E2E.json...   per run of scripts/bench/bench_e2e.py: gpusnap's cold restore
                                     against the baseline's (same run) and against its floor, its
                                     durable dump against the baseline's, that hour's disk read rate;
                                     the targets drawn across ("The process", "Host codecs")
  delta OUT.png LABEL=E2E.json...    runs of bench_e2e.py with --nowhere: what the second dump stored
                                     (delta and plain entries) against the changed bytes and the pages
                                     found in no page image of the parent ("The second dump"); a
                                     LABEL's \\n breaks its line
  cycle RUN_DIR OUT.png              one run of scripts/bench/bench_h200.sh (its e2e.json and
                                     engine.json): the whole cycle by stage, and the GPU engine per
                                     tier against its floor ("The GPU data path")

The figures of earlier runs were drawn by one script each (plot_*.py), merged here on 2026-12-07;
docs/history/README.md says which commit still has them.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any


def _plt() -> Any:
    import matplotlib  # noqa: PLC0415 - only a drawn figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


# ---- ratios -----------------------------------------------------------------------------------
def ratio_figures(path: str) -> dict[str, Any]:
    from scripts.bench.bench_e2e import rates  # noqa: PLC0415

    d = json.load(open(path))
    b, g = d["baseline"], d["gpusnap_stream"]
    r = d.get("rates") or rates(d)
    return {"restore": g["restore"] / b["restore"], "floor": r["gpusnap_stream"]["restore_over_floor"],
            "dump": g["dump"] / b["dump"], "disk": b["image_bytes"] / b["criu_restore"] / 1e9,
            "moe": d.get("workload") == "moe"}


def ratios(out: str, runs: list[tuple[str, str]]) -> None:
    plt = _plt()
    figs = [(label, ratio_figures(path)) for label, path in runs]
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
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="tab:blue"), plt.Rectangle((0, 0), 1, 1, color="tab:orange")],
               labels=["MoE-like tree (weights)", "serving (zero-heavy)"], fontsize=8, loc="upper right", ncol=2,
               bbox_to_anchor=(1.0, 0.96))
    fig.suptitle("baseline and gpusnap in the same run each time (issue 21); H200 unless the label names another card",
                 fontsize=10, x=0.4)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out, dpi=110)


# ---- delta ------------------------------------------------------------------------------------
def delta_figures(path: str) -> dict[str, float]:
    d = json.load(open(path))["gpusnap_stream"]["dedup"]
    st = d.get("second_dump_stages") or {}
    out = {"changed": d["changed_bytes"] / 1e9, "nowhere": d.get("nowhere_bytes", 0) / 1e9,
           "stored": d["second_new"] / 1e9}
    if "delta:stored as deltas" in st or "delta:stored plain" in st:
        out["as deltas"] = st.get("delta:stored as deltas", {}).get("bytes", 0) / 1e9
        out["plain"] = st.get("delta:stored plain", {}).get("bytes", 0) / 1e9
    return out


def delta(out: str, args: list[tuple[str, str]]) -> None:
    plt = _plt()
    runs = [(label.replace("\\n", "\n"), delta_figures(path)) for label, path in args]
    fig, ax = plt.subplots(figsize=(1.9 * len(runs) + 2, 4.2))
    seen: set[str] = set()

    def once(name: str) -> str | None:  # each legend entry once, at its first bar
        if name in seen:
            return None
        seen.add(name)
        return name
    for i, (label, f) in enumerate(runs):
        ax.bar(i - 0.27, f["changed"], 0.26, color="#bbbbbb", label=once("changed (the workload's count)"))
        ax.bar(i, f["nowhere"], 0.26, color="#8172b3", label=once("pages nowhere in the parent (raw)"))
        if "as deltas" in f:
            ax.bar(i + 0.27, f["as deltas"], 0.26, color="#55a868", label=once("stored: delta entries"))
            ax.bar(i + 0.27, f["plain"], 0.26, bottom=f["as deltas"], color="#dd8452",
                   label=once("stored: plain entries"))
        else:
            ax.bar(i + 0.27, f["stored"], 0.26, color="#4c72b0", label=once("stored (not split)"))
        ax.text(i + 0.27, f["stored"], f"{f['stored'] / f['changed']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(runs)), [label for label, _ in runs], fontsize=8)
    ax.set_ylabel("GB")
    ax.set_title("second dump after 5% of the KV blocks were written (H200)", fontsize=9)
    ax.set_ylim(0, 1.35 * max(max(f["changed"], f["nowhere"], f["stored"]) for _, f in runs))
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


# ---- cycle ------------------------------------------------------------------------------------
def cycle(run_dir: str, out: str) -> None:
    plt = _plt()
    e2e = json.load(open(os.path.join(run_dir, "e2e.json")))
    eng = json.load(open(os.path.join(run_dir, "engine.json")))
    b, g = e2e["baseline"], e2e["gpusnap"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6))
    rows = [("baseline\n(driver + plain CRIU)", [("driver lock+checkpoint", b["driver_lock+checkpoint"]),
                                                  ("CRIU dump + sync", b["criu_dump+sync"]),
                                                  ("CRIU restore (cold)", b["criu_restore"]),
                                                  ("driver restore+unlock", b["driver_restore+unlock"])]),
            ("gpusnap criu\n(host-staged)", [("driver lock+checkpoint", g["dump_stages"]["gpu_checkpoint"]),
                                              ("CRIU dump (tmpfs)", g["dump_stages"]["criu_dump"]),
                                              ("ingest after CRIU exits", g["dump_stages"]["ingest_after_dump"]),
                                              ("process start, discovery, cleanup",
                                               g["gpusnap_criu_dump"] + g["gpusnap_criu_restore"]
                                               - sum(v for k, v in g["dump_stages"].items()
                                                     if k in ("gpu_checkpoint", "dump+ingest"))
                                               - sum(g["restore_stages"].values())),
                                              ("materialize", g["restore_stages"]["materialize"]),
                                              ("CRIU restore (cold)", g["restore_stages"]["criu_restore"]),
                                              ("driver restore+unlock", g["restore_stages"]["gpu_restore"])])]
    colors = {"driver lock+checkpoint": "#4c72b0", "CRIU dump + sync": "#dd8452", "CRIU dump (tmpfs)": "#dd8452",
              "ingest after CRIU exits": "#c44e52", "process start, discovery, cleanup": "#bbbbbb",
              "materialize": "#8172b3", "CRIU restore (cold)": "#55a868", "driver restore+unlock": "#937860"}
    for i, (label, stages) in enumerate(rows):
        left = 0.0
        for name, sec in stages:
            ax1.barh(i, sec, left=left, color=colors[name],
                     label=name if i == 1 or name not in dict(rows[1][1]) else None)
            left += sec
        ax1.text(left + 1, i, f"{left:.1f} s", va="center")
    ax1.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax1.set_xlabel("seconds (checkpoint + restore of 25.8 GB of GPU memory, realistic mix)")
    ax1.set_title("Whole cycle on the H200, driver 580 (host-staged path; ingest overlaps the CRIU dump)")
    h, labels_ = ax1.get_legend_handles_labels()
    seen: dict[str, Any] = {}
    for hh, ll in zip(h, labels_):
        seen.setdefault(ll, hh)
    ax1.legend(seen.values(), seen.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    ax1.set_xlim(0, max(sum(x[1] for x in st) for _, st in rows) * 1.12)
    labels, ck, rs, fl = [], [], [], []
    for r in eng["rows"]:
        labels.append(f"{r['mix'][:4]}.\n{ {'shm': '/dev/shm', 'pool': 'pinned pool', 'disk': 'disk'}[r['tier']] }")
        ck.append(r["checkpoint_s"])
        rs.append(r["restore_s"])
        fl.append(r["floor_checkpoint_s"] + r["floor_restore_s"])
    x = range(len(labels))
    ax2.bar(x, ck, color="#4c72b0", label="checkpoint (GPU -> store)")
    ax2.bar(x, rs, bottom=ck, color="#55a868", label="restore (store -> GPU)")
    ax2.scatter(x, fl, color="black", marker="_", s=600, label="floor (PCIe, or disk for stored bytes)", zorder=3)
    ax2.set_xticks(list(x), labels)
    ax2.set_yscale("log")
    ax2.set_ylim(0.1, 30)
    ax2.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="memory-tier target: 1.0 s")
    ax2.set_ylabel("seconds (log)")
    ax2.set_title("GPU engine, IPC stand-in for custom storage, 25.8 GB")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)


def _labelled(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for a in items:
        label, sep, path = a.partition("=")
        if not sep:
            raise SystemExit(f"plots: {a!r} is not LABEL=FILE.json")
        out.append((label, path))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.plots", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="figure", required=True)
    for name in ("ratios", "delta"):
        s = sub.add_parser(name)
        s.add_argument("out")
        s.add_argument("runs", nargs="+", metavar="LABEL=E2E.json")
    c = sub.add_parser("cycle")
    c.add_argument("run_dir")
    c.add_argument("out")
    a = p.parse_args(argv)
    if a.figure == "ratios":
        ratios(a.out, _labelled(a.runs))
    elif a.figure == "delta":
        delta(a.out, _labelled(a.runs))
    else:
        cycle(a.run_dir, a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
