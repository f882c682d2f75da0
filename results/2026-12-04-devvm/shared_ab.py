import json, os, sys, time, shutil
sys.path.insert(0, "/work/main")
from scripts.bench.bench_criu import Tree, gpusnap
from scripts.helpers import drop_caches
mb = int(sys.argv[1]); variants = sys.argv[2:] or [""]
store = "/var/tmp/sh-store"
shutil.rmtree(store, ignore_errors=True)
t = Tree(mb, "weights", "cow")
assert t.ok()
r = gpusnap(store, "criu", "dump", str(t.pid), "s1")

t.gone()
for v in variants:
    env = dict(kv.split("=", 1) for kv in v.split(",") if kv)
    os.environ.update(env)
    drop_caches()
    t0 = time.perf_counter()
    r = gpusnap(store, "criu", "restore", "s1")
    wall = time.perf_counter() - t0
    for k in env: del os.environ[k]
    sv = r.get("stages", {}).get("served", {})
    print(f"== {v or 'default'}: wall {wall:.2f}  seconds {r.get('seconds')}", flush=True)
    print("  shared", sv.get("shared_decoded"), "cow_kept", sv.get("cow_kept_bytes"))
    for k, st in sorted(sv.get("stages", {}).items()):
        print(f"   {k:22s} {st}")
    print("  verified", t.ok(), flush=True)
    t.kill(); t.gone()
shutil.rmtree(store, ignore_errors=True)
