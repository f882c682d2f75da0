#!/usr/bin/env python3
"""Draw BENCHMARKS.md section 20's figure from recorded runs of scripts/bench/bench_e2e.py with
`--nowhere`: per run, what the second dump (after the workload wrote 5% of its KV blocks) stored,
split into delta entries and plain entries where the run counted them, against the bytes the
workload changed and the pages of the second dump found in no page image of the first (what no
delta can take from the parent, before compression).
Usage: python3 -m scripts.bench.plot_delta OUT.png LABEL=E2E.json...  (needs matplotlib)"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def figures(path: str) -> dict[str, float]:
    d = json.load(open(path))["gpusnap_stream"]["dedup"]
    st = d.get("second_dump_stages") or {}
    out = {"changed": d["changed_bytes"] / 1e9, "nowhere": d.get("nowhere_bytes", 0) / 1e9,
           "stored": d["second_new"] / 1e9}
    if "delta:stored as deltas" in st or "delta:stored plain" in st:
        out["as deltas"] = st.get("delta:stored as deltas", {}).get("bytes", 0) / 1e9
        out["plain"] = st.get("delta:stored plain", {}).get("bytes", 0) / 1e9
    return out


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    runs = [(a.split("=", 1)[0].replace("\\n", "\n"), figures(a.split("=", 1)[1])) for a in args]  # LABEL: \\n breaks a line
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


if __name__ == "__main__":
    main()
