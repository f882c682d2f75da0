#!/usr/bin/env bash
# One batch on the lent GPU machine (the `device` tool): GPU tests, then the benchmarks named in $1
# ("tests", "swap", "engine", "e2e", "speed", "moe", "fillvariants", "criutree", "codecs", "startup", "bench" = scripts/bench/bench_h200.sh,
# "pool", "storeput", "server" = scripts/bench/bench_server.py (SERVER_ARGS; WHEELS=.whl-serve), or several, comma-separated). Results land in $OUT (or ./device-out). The one-off probes and their
# modes (probe-delta, pipes, queue, fillreads, gilprof, deltaprof, knobs, hostpath, pinned, ingest, readers) went with the
# history on 2026-12-07: docs/history/README.md names the commit that still has them.
# The GPU machine has no network: carry .whl/ and .carry/ (both git-ignored, ~58 MiB together):
#   .whl/: pip download --only-binary=:all: --python-version 3.12 --no-deps --platform manylinux2014_x86_64
#          --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d .whl \
#          zstandard blake3 click rich markdown-it-py mdurl pygments pyroute2 \
#          nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13 cuda-bindings cuda-pathfinder   (numpy comes with torch there)
#   .carry/criu/: CRIU 4.2.1 built here by scripts/setup/install-criu.sh (stripped), every shared library
#          ldd lists for it except glibc's in lib/, and criu-wrapper setting LD_LIBRARY_PATH (needs glibc >= 2.35);
#          or .carry-xz/criu.tar.xz, the same folder packed (~3 MB), unpacked to /tmp when .carry/criu is not carried.
# WHEELS=.whl-dev: .whl without rich and the three it needs (make-carry.sh): what fits beside the tree and
#          .carry-xz in the 64 MiB carry since cuda-bindings 13.5 / nvCOMP 6.0 (carry [".whl-dev", ".carry-xz"]).
# FILL_WL="serving moe": the workloads `fillvariants` runs, in order.
# PIPE_MAX=67108864: fs.pipe-max-size for the whole batch (the host setting doctor advises where the limit caps
#          CRIU's page pipes; baseline and gpusnap both run under it), put back as it was when the batch ends.
# A call brings back at most 8 files from $OUT: give each batch an OUT outside it and pack that into one file,
#   e.g. `OUT=/tmp/o/moe ... device-run.sh moe; tar -C /tmp/o -cf $OUT/run.tar .` (bench_e2e --criu-logs DIR keeps
#   the CRIU logs of gpusnap's own runs there: `xz` them first).
# PACK=$OUT/run.tar (the tool's $OUT; OUT itself then outside it): the batch's folder packed into that one file
#   every 30 s and at the end, each time whole (written aside, then renamed), so a call cut at its time limit
#   still brings back what was done until then (a cut call's own `tar` after the batch never runs).
# WHEELS=.whl-lite: install from that folder instead (.whl without nvCOMP's two wheels, ~16 MiB: room in
#          the 64 MiB carry for more, e.g. .tools/py-spy.xz for `gilprof`; nothing nvCOMP runs then).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-$root/device-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
case "$(mkdir -p "$(dirname "${PACK:-/}")" && cd "$(dirname "${PACK:-/}")" && pwd)/" in
  "$out"/*) echo "device-run.sh: PACK ($PACK) lies inside OUT ($out), where the tool never looks: give PACK the tool's \$OUT and OUT a folder outside it" >&2
            exit 2 ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl 2>&1 | tail -2
export PYTHONPATH="$root:/tmp/site" PYTHONUNBUFFERED=1
# Byte-code as an installed gpusnap has it (pip compiles at install): without it every command compiled
# each module it imports again (0.8 s per command on the H200, BENCHMARKS.md section 17). Written
# outside the tree, which need not be writable here.
echo "bytecode before: PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}, tree writable: $([ -w cli ] && echo yes || echo no), cli/__pycache__: $(ls cli/__pycache__ 2>/dev/null | wc -l) files" > "$out/bytecode.txt"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/gpusnap-pycache
python3 -m compileall -q -j 0 cli sandbox storage criu_hooks scripts /tmp/site > /dev/null 2>&1 || true
# storage/native's C helpers (byte planes, page counts): kept when carried (its two .so files, built here), else
# built if this machine has a compiler and the tree is writable, else numpy does their work (doctor says which)
python3 -m storage.native.build > /dev/null 2>&1 || true
if [ -d .carry/criu ]; then export GPUSNAP_CRIU="$root/.carry/criu/criu-wrapper"; fi
if [ ! -d .carry/criu ] && [ -f .carry-xz/criu.tar.xz ]; then  # the packed CRIU (make-carry.sh), unpacked outside the tree
  criu_dir=$(mktemp -d /tmp/gpusnap-criu.XXXXXX) && tar -C "$criu_dir" -xJf .carry-xz/criu.tar.xz \
    && export GPUSNAP_CRIU="$criu_dir/criu/criu-wrapper"
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r; nproc
  echo "THP $(cat /sys/kernel/mm/transparent_hugepage/enabled) defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
  echo "free page reporting order: $(cat /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null || echo none)," \
       "balloon features: $(cat /sys/bus/virtio/drivers/virtio_balloon/virtio*/features 2>/dev/null | head -c 8 || echo none)"; } > "$out/machine.txt" 2>&1
if [ -n "${PIPE_MAX:-}" ]; then
  pipe_max_before=$(cat /proc/sys/fs/pipe-max-size)
  trap 'echo "$pipe_max_before" > /proc/sys/fs/pipe-max-size' EXIT
  trap 'exit 143' TERM INT
  echo "$PIPE_MAX" > /proc/sys/fs/pipe-max-size && echo "fs.pipe-max-size $pipe_max_before -> $PIPE_MAX for this batch" >> "$out/machine.txt"
fi
pack() {  # $out into $PACK, whole or not at all
  [ -n "${PACK:-}" ] || return 0
  tar -C "$(dirname "$out")" -cf "$PACK.part" "$(basename "$out")" 2>/dev/null && mv -f "$PACK.part" "$PACK"
}
if [ -n "${PACK:-}" ]; then (while sleep 30 && kill -0 $$ 2>/dev/null; do pack; done) & packer=$!; fi
python3 -m cli doctor > "$out/doctor.txt" 2>&1
python3 -m cli doctor --json > "$out/doctor.json" 2>&1
for what in ${1//,/ }; do
  case "$what" in
    tests)  GPUSNAP_RESULTS="$out/gpu-results.jsonl" timeout ${TESTS_TIMEOUT:-560} python3 -m pytest -p no:cacheprovider -m gpu -v -s --durations=20 ${PYTEST_K:+-k "$PYTEST_K"} tests 2>&1 | tee "$out/gpu-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E |s call" ;;
    engine) timeout 560 python3 -m scripts.bench.bench_gpu_engine --json "$out/engine.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/engine.log" ;;
    bench)  OUT="$out" bash scripts/bench/bench_h200.sh ;;
    swap)   # issue 57: `gpusnap swap` with two transformers servers over the budget (gpu mode, then criu)
            timeout ${SWAP_TIMEOUT:-540} python3 -m scripts.bench.bench_swap --out "$out/swap.json" ${SWAP_ARGS:-} 2>&1 | tee "$out/swap.log" ;;
    pool)   for l in ${POOL_LANES:-16 24}; do timeout 200 python3 -m scripts.bench.bench_gpu_engine --mix realistic --tiers shm,pool --repeat 5 --lanes $l --json "$out/pool-lanes$l.json" 2>&1 | tee "$out/pool-lanes$l.log"; done ;;
    storeput) # `store put`/`get` against cp on this host, packs written direct and buffered (BENCHMARKS.md section 39)
            for d in 1 0; do GPUSNAP_PUT_DIRECT=$d timeout ${STORE_TIMEOUT:-150} python3 -m scripts.bench.bench_store --gb ${STORE_GB:-4} \
              --mix weights --rounds ${STORE_ROUNDS:-3} --json "$out/store-direct$d.json" 2>&1 | tee "$out/store-direct$d.log" | tail -3; done ;;
    speed)  # issue 17: the serving workload smoke-tested at 1 GB, then baseline vs gpusnap (stream, staging) at $BENCH_GB
            python3 -X importtime -m cli --help 2> "$out/importtime.txt" > /dev/null
            wl=serving
            timeout 120 python3 -m scripts.workloads.serving_smoke 2>&1 | tee "$out/serving-smoke.log" | tail -3 || wl=synthetic
            grep -q '"ok": true' "$out/serving-smoke.log" || wl=synthetic
            timeout ${E2E_TIMEOUT:-540} python3 -m scripts.bench.bench_e2e --gb ${BENCH_GB:-20} --workload $wl --paths ${BENCH_PATHS:-stream,staging} ${BENCH_ARGS:-} \
              --json "$out/e2e-speed-${BENCH_GB:-20}.json" 2>&1 | tee "$out/e2e-speed-${BENCH_GB:-20}.log"
            if [ -n "${BENCH_GB2:-}" ]; then  # a second, larger size: baseline and the first path only
              timeout ${E2E_TIMEOUT2:-300} python3 -m scripts.bench.bench_e2e --gb $BENCH_GB2 --workload $wl --paths ${BENCH_PATHS%%,*} --no-dedup \
                --json "$out/e2e-speed-$BENCH_GB2.json" 2>&1 | tee "$out/e2e-speed-$BENCH_GB2.log"
            fi ;;
    codecs) timeout ${CODECS_TIMEOUT:-300} python3 -m scripts.bench.bench_codecs --mib ${CODECS_MIB:-256} --threads 1,$(nproc) \
              --json "$out/codecs.json" 2>&1 | tee "$out/codecs.log" ;;
    moe)    # issue 21: the weights-dominated two-process tree smoke-tested at 1 GB, then baseline vs gpusnap at $BENCH_GB
            timeout 120 python3 -m scripts.workloads.serving_smoke moe_workload.py 2>&1 | tee "$out/moe-smoke.log" | tail -3
            timeout ${E2E_TIMEOUT:-540} python3 -m scripts.bench.bench_e2e --gb ${BENCH_GB:-20} --workload moe --paths ${BENCH_PATHS:-stream} \
              ${BENCH_ARGS:-} --json "$out/e2e-moe-${BENCH_GB:-20}.json" 2>&1 | tee "$out/e2e-moe-${BENCH_GB:-20}.log" ;;
    startup) # what a cold start of the CLI costs on this machine: the imports of `criu restore`, cold and warm
            for i in cold warm; do [ $i = cold ] && { sync; echo 3 > /proc/sys/vm/drop_caches; }
              /usr/bin/time -f "$i import of cli.criu_cmd: %e s" python3 -X importtime -c "import cli.criu_cmd" 2> "$out/importtime-$i.txt"
              tail -1 "$out/importtime-$i.txt"; sort -t'|' -k2 -n "$out/importtime-$i.txt" | tail -6; done ;;
    fillvariants) # the fill's processes against its reads in flight (BENCHMARKS.md section 27): serving and MoE at $BENCH_GB,
            # gpusnap only, each snapshot restored cold with the defaults, then 8 decoding workers sharing 4 reads, then
            # the defaults again (the spread), then 8 workers holding nothing while CRIU runs, then the host's THP
            # setting kept (GPUSNAP_THP=keep: restores 0.64-1.05x on the development VM, BENCHMARKS.md section 28)
            for wl in ${FILL_WL:-serving moe}; do
              timeout ${E2E_TIMEOUT:-260} python3 -m scripts.bench.bench_e2e --gb ${BENCH_GB:-20} --workload $wl --paths stream \
                --skip-baseline --no-dedup --floor-gb 2 --restore-variant GPUSNAP_FILL_PROCS=8 --restore-variant GPUSNAP_FILL_PROCS=4 \
                --restore-variant GPUSNAP_FILL_PROCS=8,GPUSNAP_FILL_HELD=0 --restore-variant GPUSNAP_THP=keep --json "$out/fillvariants-$wl.json" 2>&1 \
                | grep -E "^(==|disk floor|gpusnap/|  )" | tee "$out/fillvariants-$wl.txt"; done ;;
    criutree) # CPU process trees through CRIU against plain CRIU on this machine's 16 cores (BENCHMARKS.md sections
            # 28-29): a forked tree sharing its weights copy-on-write (CRIU restores all of it; its feeds decode
            # into reused buffers since 1b7c237), then one whose processes hold their own
            for sh in ${TREE_SHARING:-cow private}; do
              timeout ${TREE_TIMEOUT:-280} python3 -m scripts.bench.bench_criu --mb ${TREE_MB:-4096} --data weights --sharing $sh \
                --rounds ${TREE_ROUNDS:-2} --json "$out/criutree-$sh.json" 2>&1 | tee "$out/criutree-$sh.txt" | tail -6; done ;;
    server) timeout ${SERVER_TIMEOUT:-580} python3 -m scripts.bench.bench_server --out "$out/server.json" ${SERVER_ARGS:-} 2>&1 | tee "$out/server.log" ;;  # WHEELS=.whl-serve (make-carry.sh)
    e2e)    timeout 560 python3 -m scripts.bench.bench_e2e --json "$out/e2e.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/e2e.log" ;;
  esac
done
if [ -n "${PACK:-}" ]; then pkill -P "$packer" 2>/dev/null; kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null; pack; fi
