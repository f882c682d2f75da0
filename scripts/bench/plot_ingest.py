#!/usr/bin/env python3
"""Draw BENCHMARKS.md section 26's figure: the dump's ingest rate (GB/s of CRIU image) and the durable
dump against the baseline's (same run), per recorded run of scripts/bench/bench_e2e.py, the put's
chunk work in threads or in encoder processes. Each input is an e2e JSON, or the summary lines a run
printed (a .txt holding bench_e2e's `ingest_gbps` and `ratios ... dump` lines) where its JSON did not
come back.
Usage: python3 -m scripts.bench.plot_ingest OUT.png LABEL=FILE[:threads|:procs]...  (needs matplotlib)"""
from __future__ import annotations

import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def figures(path: str) -> tuple[float, float]:
    """(ingest GB/s, dump / baseline dump) of one run."""
    if path.endswith(".json"):
        d = json.load(open(path))
        g, b = d["gpusnap_stream"], d["baseline"]
        return d["rates"]["gpusnap_stream"]["ingest_gbps"], g["dump"] / b["dump"]
    text = open(path).read()
    ingest = re.search(r"ingest_gbps (\S+)", text)
    dump = re.search(r"ratios \(gpusnap / baseline\): dump (\S+)", text)
    if not ingest or not dump:
        raise SystemExit(f"{path}: no ingest_gbps or dump ratio line")
    return float(ingest.group(1)), float(dump.group(1))


def main() -> None:
    out, runs = sys.argv[1], sys.argv[2:]
    labels, ingest, dump, colors = [], [], [], []
    for r in runs:
        label, spec = r.split("=", 1)
        path, _, mode = spec.partition(":")
        i, d = figures(path)
        labels.append(label)
        ingest.append(i)
        dump.append(d)
        colors.append("tab:green" if mode == "procs" else "tab:gray")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(labels))
    a1.bar(x, ingest, color=colors)
    a1.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
    a1.set_ylabel("dump ingest, GB/s of image")
    a1.set_title("ingest (grey: threads, green: encoder processes)")
    a2.bar(x, dump, color=colors)
    a2.axhline(0.7, color="tab:red", linestyle="--", label="target 0.7x")
    a2.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
    a2.set_ylabel("durable dump / baseline (same run)")
    a2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
