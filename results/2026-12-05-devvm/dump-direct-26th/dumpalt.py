# one CRIU tree (1 GiB bf16 weights), dumped --leave-running alternately with direct and buffered packs
import json, os, shutil, subprocess, sys, tempfile, time
sys.path.insert(0, "/work/main")
from scripts.workloads.criu_tree import CriuTree
from scripts.helpers import REPO, child_env, drop_caches
ORDER = sys.argv[1].split(",") if len(sys.argv) > 1 else ["1", "0"]
work = tempfile.mkdtemp(prefix="dumpalt-", dir="/var/tmp")
t = CriuTree(1024, data="weights", sharing="private", prefix="dumpalt-tree-", start_timeout=600)
try:
    assert t.ok()
    for i, d in enumerate(ORDER * 4):
        store = os.path.join(work, f"s{i}")
        drop_caches(required=True)
        env = child_env(GPUSNAP_DUMP_DIRECT=d)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "cli", "--store", store, "criu", "dump", "--leave-running", str(t.pid), "b", "--json"],
                             capture_output=True, text=True, env=env, cwd=REPO)
        os.sync()
        dt = time.perf_counter() - t0
        r = json.loads(out.stdout) if out.returncode == 0 else {"err": out.stderr[-300:]}
        print(f"DUMP_DIRECT={d}: {dt:.2f} s", {k: r.get("seconds", {}).get(k) for k in ("criu_dump", "dump+ingest")} if "err" not in r else r, flush=True)
        shutil.rmtree(store)
    assert t.ok()
finally:
    t.gone() if hasattr(t, "gone") else None
    shutil.rmtree(work, ignore_errors=True)
