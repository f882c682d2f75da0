#!/usr/bin/env python3
"""Does a second engine checkpoint of unchanged GPU memory deduplicate? Per lane count and codec."""
import os, tempfile, shutil
from scripts.workloads.workload_control import Workload, ipc_region
from storage.pipeline.gpu_engine import GpuEngine, Region
from storage.repo.store import SnapshotStore

with Workload(1, mix="realistic", seed=2) as w, GpuEngine(lanes=1) as _ctx, ipc_region(w.info["ipc"]) as ptr:
    for codec in ("nvcomp-ans", "nvcomp-bitcomp"):
        for lanes in (1, 8):
            d = tempfile.mkdtemp(dir="/dev/shm")
            st = SnapshotStore(os.path.join(d, "s"))
            with GpuEngine(lanes=lanes, codec=codec) as eng:
                res = []
                for name in ("a", "b"):
                    with st.writer(name) as wr:
                        eng.checkpoint(wr, [Region("g", ptr, w.size)])
                        wr.commit()
                        res.append((wr.stats.chunks_new, wr.stats.chunks_dedup, wr.stats.chunks_zero))
            ids = [[c.id for c in st.load(n).streams[0].chunks] for n in ("a", "b")]
            same = sum(1 for x, y in zip(*ids) if x == y)
            print(codec, "lanes", lanes, "new/dedup/zero", res, "same ids", same, "of", len(ids[0]))
            shutil.rmtree(d)
