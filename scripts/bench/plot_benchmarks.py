#!/usr/bin/env python3
"""Draw BENCHMARKS.md's figure from one recorded H200 run of scripts/bench/bench_h200.sh.
Usage: python3 -m scripts.bench.plot_benchmarks [RESULTS_DIR] [OUT.png] (default: the final run of 2026-11-29)."""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from scripts.helpers import REPO  # noqa: E402
R = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "results", "2026-11-29-h200", "s2-5-ingest-bench")
e2e = json.load(open(os.path.join(R, "e2e.json")))
eng = json.load(open(os.path.join(R, "engine.json")))
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
                                           - sum(v for k, v in g["dump_stages"].items() if k in ("gpu_checkpoint", "dump+ingest"))
                                           - sum(g["restore_stages"].values())),
                                          ("materialize", g["restore_stages"]["materialize"]),
                                          ("CRIU restore (cold)", g["restore_stages"]["criu_restore"]),
                                          ("driver restore+unlock", g["restore_stages"]["gpu_restore"])])]
colors = {"driver lock+checkpoint": "#4c72b0", "CRIU dump + sync": "#dd8452", "CRIU dump (tmpfs)": "#dd8452",
          "ingest after CRIU exits": "#c44e52", "process start, discovery, cleanup": "#bbbbbb", "materialize": "#8172b3", "CRIU restore (cold)": "#55a868",
          "driver restore+unlock": "#937860"}
for i, (label, stages) in enumerate(rows):
    left = 0.0
    for name, sec in stages:
        ax1.barh(i, sec, left=left, color=colors[name], label=name if i == 1 or name not in dict(rows[1][1]) else None)
        left += sec
    ax1.text(left + 1, i, f"{left:.1f} s", va="center")
ax1.set_yticks(range(len(rows)), [r[0] for r in rows])
ax1.set_xlabel("seconds (checkpoint + restore of 25.8 GB of GPU memory, realistic mix)")
ax1.set_title("Whole cycle on the H200, driver 580 (host-staged path; ingest overlaps the CRIU dump)")
h, l = ax1.get_legend_handles_labels()
seen = {}
for hh, ll in zip(h, l):
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
out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(REPO, "docs", "benchmarks.png")
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
fig.savefig(out, dpi=110)
print(out)
