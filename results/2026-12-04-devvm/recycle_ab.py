import json, os, sys, time, shutil, subprocess
sys.path.insert(0, "/work/main")
from scripts.bench.bench_criu import Tree
from scripts.helpers import drop_caches
mb = int(sys.argv[1]); sharing = sys.argv[2]; repos = sys.argv[3:]
store = "/var/tmp/rc-store"
shutil.rmtree(store, ignore_errors=True)
def gs(repo, *args):
    p = subprocess.run([sys.executable, "-m", "cli", "--store", store, *args, "--json"], capture_output=True, text=True,
                       cwd=repo, env=dict(os.environ, PYTHONPATH=repo))
    if p.returncode: raise SystemExit(p.stderr)
    return json.loads(p.stdout)
t = Tree(mb, "weights", sharing)
assert t.ok()
gs(repos[0], "criu", "dump", str(t.pid), "s1")
t.gone()
for repo in repos:
    drop_caches()
    t0 = time.perf_counter()
    r = gs(repo, "criu", "restore", "s1")
    wall = time.perf_counter() - t0
    st = (r.get("stages", {}).get("served") or {}).get("stages", {}).get("read+decode+verify", {})
    print(f"== {repo}: wall {wall:.2f} seconds {r.get('seconds')} read+decode+verify {st.get('thread_seconds')} s {st.get('bytes')} B verified {t.ok()}", flush=True)
    t.kill(); t.gone()
shutil.rmtree(store, ignore_errors=True)
