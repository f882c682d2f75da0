#!/usr/bin/env python3
"""Where a second `criu dump` of a workload finds its parent's bytes (issue 21, delta entries).

    python -m scripts.device.probe_delta [--gb 2] [--workload moe] [--percent 5]

Dumps the workload, restores it, lets it change PERCENT of its state (`mutate`), dumps it again with
--parent, then compares the two snapshots' page images page by page (4 KiB): for each page image of
the second, how many of its non-zero pages are identical to the parent's page at the same offset,
how many exist elsewhere in the parent's image of the same name (and at which shifts), how many are
new; and what the second dump's report says it stored as deltas. Prints one JSON object per image.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from scripts.bench.bench_e2e import SCRIPTS, gpusnap, verify
from scripts.helpers import REPO, child_env, drop_caches
from scripts.workloads.workload_control import Workload
from storage.pipeline.put import page_keys

PAGE = 4096


def image(store: str, snap: str, stream: str) -> np.ndarray:
    env = child_env()
    out = subprocess.run([sys.executable, "-m", "cli", "--store", store, "store", "cat", snap, stream],
                         capture_output=True, check=True, env=env).stdout
    n = len(out) // PAGE * PAGE
    return np.frombuffer(out, np.uint8, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2)
    ap.add_argument("--workload", choices=sorted(SCRIPTS), default="moe")
    ap.add_argument("--percent", type=float, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the store in place (its path is printed)")
    ap.add_argument("--device", default=None, help="the workload's --device (cpu: no GPU, for trying this out)")
    a = ap.parse_args()
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the restored tree comes back to us to reap
    work = tempfile.mkdtemp(prefix="gpusnap-probe-delta-", dir="/var/tmp")
    store = os.path.join(work, "store")
    try:
        extra = ("--device", a.device) if a.device else ()
        with Workload(a.gb, mix="realistic", seed=21, detached=True, script=SCRIPTS[a.workload], extra=extra) as w:
            d1 = gpusnap(store, "criu", "dump", str(w.pid), "e2e")
            w.reap()
            drop_caches()
            gpusnap(store, "criu", "restore", "e2e")
            changed = w.cmd(f"mutate {a.percent}")
            d2 = gpusnap(store, "criu", "dump", "--leave-running", "--parent", "e2e", str(w.pid), "e2e-b")
            print(json.dumps({"first_new": d1["new_bytes"], "second_new": d2["new_bytes"], "changed": changed,
                              "parent": d2.get("parent"), "verified": verify(w)["ok"],
                              "delta_stages": {k: v for k, v in (d2.get("stages") or {}).items()
                                               if k.startswith("delta") or k == "compress"}}), flush=True)
        env = child_env()
        ls = {}
        for snap in ("e2e", "e2e-b"):
            p = subprocess.run([sys.executable, "-m", "cli", "--store", store, "store", "ls", snap, "--json"],
                               capture_output=True, text=True, env=env)
            ls[snap] = p.stdout
        names = sorted({ln for ln in ls["e2e-b"].replace('"', " ").split() if "pages-" in ln and ln.endswith(".img")})
        print(json.dumps({"page_images_second": names,
                          "page_images_first": sorted({ln for ln in ls["e2e"].replace('"', " ").split()
                                                       if "pages-" in ln and ln.endswith(".img")})}), flush=True)
        first = sorted({ln for ln in ls["e2e"].replace('"', " ").split() if "pages-" in ln and ln.endswith(".img")})
        zero = int(page_keys(np.zeros(PAGE, np.uint8))[0])
        # every non-zero page of the parent's page images, wherever it is: (key, image, page index)
        keys, img, idx = [], [], []
        for j, name in enumerate(first):
            k = page_keys(image(store, "e2e", name))
            nz = np.nonzero(k != zero)[0]
            keys.append(k[nz]), img.append(np.full(len(nz), j, np.int32)), idx.append(nz.astype(np.int64))
            print(json.dumps({"parent_image": name, "pages": len(k), "nonzero": len(nz)}), flush=True)
        keys, img, idx = np.concatenate(keys), np.concatenate(img), np.concatenate(idx)
        order = np.argsort(keys, kind="stable")
        keys, img, idx = keys[order], img[order], idx[order]
        for name in names:
            kn = page_keys(image(store, "e2e-b", name))
            nzi = np.nonzero(kn != zero)[0]
            pos = np.searchsorted(keys, kn[nzi])
            pos = np.minimum(pos, len(keys) - 1)
            hit = keys[pos] == kn[nzi]
            by_img = collections.Counter(first[int(j)] for j in img[pos[hit]])
            shifts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
            for i, p_ in zip(nzi[hit], pos[hit]):
                shifts[first[int(img[p_])]][int(idx[p_]) - int(i)] += 1
            print(json.dumps({"image": name, "pages": len(kn), "nonzero": len(nzi), "found": int(hit.sum()),
                              "new": int((~hit).sum()), "found_in": by_img.most_common(6),
                              "top_shifts_pages": {k: v.most_common(6) for k, v in shifts.items()}}), flush=True)
    finally:
        if a.keep:
            print(json.dumps({"store": store}), flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
