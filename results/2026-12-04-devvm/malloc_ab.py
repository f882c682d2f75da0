import json, os, sys, time, shutil
sys.path.insert(0, "/work/main")
from scripts.bench.bench_criu import Tree, gpusnap
from scripts.helpers import drop_caches
mb = int(sys.argv[1]); sharing = sys.argv[2]; variants = sys.argv[3:]
for rnd, v in enumerate(variants):
    env = dict(kv.split("=", 1) for kv in v.split(",") if kv)
    store = "/var/tmp/ma-store"
    shutil.rmtree(store, ignore_errors=True)
    t = Tree(mb, "weights", sharing)
    assert t.ok()
    drop_caches()
    t0 = time.perf_counter()
    r = gpusnap(store, "criu", "dump", str(t.pid), "s1", env=env)
    dump = time.perf_counter() - t0
    st = r.get("stages", {})
    t.gone()
    drop_caches()
    t0 = time.perf_counter()
    r2 = gpusnap(store, "criu", "restore", "s1", env=env)
    rest = time.perf_counter() - t0
    print(f"== {v or 'default'}: dump {dump:.2f} restore {rest:.2f} seconds {r2.get('seconds')} verified {t.ok()}", flush=True)
    ing = {k: round(x.get('thread_seconds', 0), 2) for k, x in (r.get('stages', {}).get('ingest') or {}).items()} if isinstance(r.get('stages', {}).get('ingest'), dict) else None
    print("   dump seconds", r.get("seconds"), flush=True)
    t.kill()
    shutil.rmtree(store, ignore_errors=True)
