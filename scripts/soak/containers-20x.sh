#!/usr/bin/env bash
# Soak: the runc and Podman checkpoint/restore tests (tests/test_containers.py) N times in a row
# (default 20) while busy loops keep every core loaded, each run under a time limit, so that a hang
# shows up as a timeout instead of a stuck suite. Prints one line per run and a summary; the busy
# loops are stopped on exit whatever happens.
#   scripts/soak/containers-20x.sh [N] [-k EXPR]    (as root; CRIU >= 4.2 first on PATH or in .cache)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
n=${1:-20}; shift || true
expr="checkpoint_restore_runs_the_hook or through_the_store or gpu_"
if [ "${1:-}" = "-k" ]; then expr=$2; fi
limit=${SOAK_RUN_LIMIT:-600}            # seconds one run may take before it counts as a hang
burners=${SOAK_BURNERS:-$(nproc)}
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=$(command -v python3)
[ -x "$root/.cache/criu/bin/criu" ] && export PATH="$root/.cache/criu/bin:$PATH"

cd "$root"
pids=()
run_pid=
stop() {
    [ -n "$run_pid" ] && kill "$run_pid" 2>/dev/null
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
}
trap stop EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$burners"); do
    sh -c 'while :; do :; done' &
    pids+=($!)
done

pass=0; fail=0; hang=0; times=()
for i in $(seq "$n"); do
    t0=$(date +%s.%N)
    # its own base temp: pytest's clean-up of old numbered directories is not shared with other suites
    bt=$(mktemp -d /tmp/soak-containers-bt-XXXXXX)
    timeout -k 30 "$limit" "$py" -m pytest -q -x -p no:cacheprovider --basetemp="$bt" tests/test_containers.py \
        -k "$expr" >"/tmp/soak-containers-$$-$i.log" 2>&1 &
    run_pid=$!
    wait "$run_pid"
    rc=$?
    run_pid=

    t=$(echo "$(date +%s.%N) - $t0" | bc)
    times+=("$t")
    load=$(cut -d' ' -f1 /proc/loadavg)
    case $rc in
        0) pass=$((pass + 1)); what=pass; rm -rf "/tmp/soak-containers-$$-$i.log" "$bt" ;;
        124|137) hang=$((hang + 1)); what="HANG (over ${limit} s): /tmp/soak-containers-$$-$i.log" ;;
        *) fail=$((fail + 1)); what="FAIL rc=$rc: /tmp/soak-containers-$$-$i.log" ;;
    esac
    printf 'run %2d/%d  %6.1f s  load %s  %s\n' "$i" "$n" "$t" "$load" "$what"
done
sorted=$(printf '%s\n' "${times[@]}" | sort -n)
printf 'soak: %d runs, %d passed, %d failed, %d hung; per run min %.1f s, median %.1f s, max %.1f s (%d busy loops)\n' \
    "$n" "$pass" "$fail" "$hang" "$(echo "$sorted" | head -n1)" "$(echo "$sorted" | sed -n "$(( (n + 1) / 2 ))p")" \
    "$(echo "$sorted" | tail -n1)" "$burners"
[ $((fail + hang)) -eq 0 ]
