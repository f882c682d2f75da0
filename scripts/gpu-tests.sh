#!/usr/bin/env bash
# Run the GPU tests (marker `gpu`) on a machine with an NVIDIA GPU, e.g. the H200 test machine:
#   scripts/gpu-tests.sh [pytest args]
# With carried wheels in .whl/ (no network there; WHEELS=.whl-dev for the trimmed set make-carry.sh
# builds) they are installed to /tmp/site first.
# Results (JSON lines) go to ${GPUSNAP_RESULTS:-gpu-results.jsonl}.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
wheels=${WHEELS:-.whl}
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl >&2 || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# storage/native's C helpers (kept when built already, e.g. carried); numpy does their work without them
python3 -m storage.native.build >&2 || echo "gpu-tests.sh: storage/native not built: numpy does its work (byte planes, page counts)" >&2
export GPUSNAP_RESULTS=${GPUSNAP_RESULTS:-$root/gpu-results.jsonl}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -m pytest -p no:cacheprovider -m gpu -v -s "$@" tests
rc=$?
[ "$rc" -eq 5 ] && { echo "gpu-tests.sh: no GPU tests collected" >&2; exit 1; }
exit $rc
