#!/usr/bin/env bash
# The whole-system benchmark (issue 7), one command on the H200 test machine, every figure from one run:
#   1-2. bench_e2e.py: baseline (driver + plain CRIU to disk) vs `gpusnap criu` (host-staged), 24 GB
#        realistic, memory verified after each restore; 4. the dedup dump after a 5% rewrite;
#   3.   bench_gpu_engine.py: the custom-storage engine (CUDA IPC stand-in), 24 GB, realistic and
#        pessimistic, to the memory tier (/dev/shm store and the resident pinned pool) and to disk,
#        with the PCIe and disk floors measured in the same run.
# Results: $OUT (or device-out/<date>-h200/) engine.json/.log, e2e.json/.log, wall.txt.
# Usage (on the GPU machine, wheels carried): bash scripts/device/device-run.sh bench
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-$root/device-out/$(date +%F)-h200}
mkdir -p "$out"
t0=$(date +%s)
timeout 280 python3 -m scripts.bench.bench_gpu_engine --gb "${BENCH_GB:-24}" --mix realistic,pessimistic \
  --tiers shm,pool,disk --repeat 3 --json "$out/engine.json" 2>&1 | tee "$out/engine.log"
t1=$(date +%s)
timeout 420 python3 -m scripts.bench.bench_e2e --gb "${BENCH_GB:-24}" --mix realistic --json "$out/e2e.json" 2>&1 | tee "$out/e2e.log"
t2=$(date +%s)
echo "engine $((t1 - t0)) s, e2e $((t2 - t1)) s, total $((t2 - t0)) s" | tee "$out/wall.txt"
