import json, os, subprocess, sys, time
sys.path.insert(0, ".")
from scripts.workloads.criu_tree import CriuTree, healthy
from scripts.helpers import drop_caches
store = "/var/tmp/mixstore"
subprocess.run(["rm", "-rf", store])
# argv: MB ROUNDS SPLIT_MINS [SHARING]; SHARING private (default) or own
t = CriuTree(int(sys.argv[1]), data="mixed", sharing=sys.argv[4] if len(sys.argv) > 4 else "private", start_timeout=600)
assert t.ok()
r = subprocess.run([sys.executable, "-m", "cli", "--store", store, "criu", "dump", str(t.pid), "m", "--json"], capture_output=True, text=True)
assert r.returncode == 0, r.stderr
t.gone()
variants = sys.argv[3].split(",")
for rnd in range(int(sys.argv[2])):
    for v in (variants if rnd % 2 == 0 else variants[::-1]):
        drop_caches(required=True)
        env = {**os.environ, "GPUSNAP_CRIU_SPLIT_MIN": v}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "cli", "--store", store, "criu", "restore", "m", "--json"], capture_output=True, text=True, env=env)
        s = time.perf_counter() - t0
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        sv = d["stages"]["served"]
        st = sv.get("stages", {})
        ok = healthy(t.report())
        print(json.dumps({"split_min": v, "s": round(s, 2), "ok": ok, "seconds": d["seconds"], "moved": sv.get("moved_bytes"),
                          "split": sv.get("split"), "why": sv.get("split_skipped_because"),
                          "ts": {k: round(x["thread_seconds"], 2) for k, x in st.items()}}), flush=True)
        t.kill(); t.gone()
