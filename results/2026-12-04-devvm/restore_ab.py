import json, os, sys, time, shutil, subprocess
sys.path.insert(0, "/work/main")
from scripts.bench.bench_criu import Tree, gpusnap
from scripts.helpers import drop_caches
mb = int(sys.argv[1]); variants = sys.argv[2:] or [""]
store = "/var/tmp/fx-store"
shutil.rmtree(store, ignore_errors=True)
t = Tree(mb)
r = gpusnap(store, "criu", "dump", str(t.pid), "s1")
t.gone()
for v in variants:
    env = dict(kv.split("=") for kv in v.split(",") if kv)
    os.environ.update(env)
    drop_caches()
    t0 = time.perf_counter()
    r = gpusnap(store, "criu", "restore", "s1")
    wall = time.perf_counter() - t0
    for k in env: del os.environ[k]
    s = r.get("stages", {})
    sv = s.get("served", {})
    print(f"== {v or 'default'}: wall {wall:.2f}  seconds {r.get('seconds')}")
    print("  fill_memory", sv.get("fill_memory"), "split", sv.get("split"))
    for k, st in sorted(sv.get("stages", {}).items()):
        print(f"   {k:22s} {st}")
    ok = t.ok()
    print("  verified", ok)
    t.kill()
shutil.rmtree(store, ignore_errors=True)
