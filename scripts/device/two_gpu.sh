#!/usr/bin/env bash
# Issue 23 in one batch on a two-GPU machine (the device tool's nvidia-h200-x2): the gpu-marked
# device-map tests, then scripts/device/two_gpu.py's steps (env, a: a process on both GPUs in place,
# c: restores onto the other GPU and the refusals, d: GB/s per GPU, b: tensor-parallel workers with
# NCCL). Results land in $OUT (or ./two-gpu-out): two-gpu.jsonl, two-gpu.log, tp-logs.txt,
# gpu-tests.log, gpu-results.jsonl, machine.txt, doctor.json (7 files: the tool brings back 8).
#
#   device run, kind nvidia-h200-x2, carry [".whl", ".carry"]:  bash scripts/device/two_gpu.sh
#
# .whl: the wheels device-run.sh names (cuda-bindings, zstandard, blake3, click for cp312); .carry/criu:
# CRIU built here by scripts/setup/install-criu.sh with its libraries and criu-wrapper (without it the
# CRIU parts are recorded as skipped). TWO_GPU_STEPS picks steps (default tests,env,a,c,d,b). The
# whole run keeps within TWO_GPU_BUDGET seconds (default 560, under the tool's 10 minutes a call):
# the batch gets what the tests left, step b (last) is the one cut short; then a second call with
# TWO_GPU_STEPS=env,b runs it alone.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-$root/two-gpu-out}
mkdir -p "$out"
# NVLink multicast stays off in every process started from here (the device notes): NCCL, PyTorch, NVSHMEM
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="$root:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -x .carry/criu/criu-wrapper ]; then export GPUSNAP_CRIU="$root/.carry/criu/criu-wrapper"; fi
{ date -u; nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used --format=csv,noheader
  nvidia-smi topo -m; uname -r; nproc; env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)_' | sort; } > "$out/machine.txt" 2>&1
python3 -m cli doctor --json > "$out/doctor.json" 2>&1
steps=${TWO_GPU_STEPS:-tests,env,a,c,d,b}
if [[ ",$steps," == *,tests,* ]]; then
  GPUSNAP_RESULTS="$out/gpu-results.jsonl" GPUSNAP_TEST_GB=${GPUSNAP_TEST_GB:-2} timeout ${TESTS_TIMEOUT:-200} \
    python3 -m pytest -p no:cacheprovider -m gpu -v -s tests/test_gpu_device_map.py \
      "tests/test_gpu_real.py::test_cli_gpu_checkpoint_and_restore" 2>&1 | tee "$out/gpu-tests.log" \
      | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E "
fi
batch=$(echo ",$steps," | sed 's/,tests,/,/; s/^,//; s/,$//')
if [ -n "$batch" ]; then
  left=$(( ${TWO_GPU_BUDGET:-560} - SECONDS ))
  [ "$left" -ge 30 ] || { echo "two_gpu.sh: ${left} s left, too little for the batch ($batch)"; exit 1; }
  echo "two_gpu.sh: the batch ($batch) gets ${left} s"
  timeout $left python3 -m scripts.device.two_gpu --out "$out" --steps "$batch" ${TWO_GPU_ARGS:-} 2>&1 \
    | tee "$out/two-gpu.log" | grep -E '"ok": (true|false)' | cut -c1-300
fi
echo "two_gpu.sh: results in $out"
