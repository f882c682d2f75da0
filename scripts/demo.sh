#!/usr/bin/env bash
# The main job, end to end, on a fresh Debian 12 machine (as root): set up (idempotent, cached), then
# checkpoint a real running process with CRIU into the embedded default store, show it gone, restore
# it from the store (verified), and show it carries on counting from where it was.
# On a machine with an NVIDIA GPU and the driver's checkpoint API, `gpusnap doctor` says so, and
# `gpusnap gpu checkpoint/restore` and `gpusnap criu dump` take the GPU state too (README).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
export PATH="$root/.venv/bin:$root/.cache/criu/bin:$PATH"
g=gpusnap
name=demo-$(date +%H%M%S)-$$
work=$(mktemp -d /tmp/gpusnap-demo.XXXXXX)
trap 'rm -rf "$work"' EXIT

count() {  # the last number the counter wrote to $1 (0 before its first line)
    local n
    n=$(tail -n1 "$1" 2>/dev/null | cut -d' ' -f1)
    echo "${n:-0}"
}
wait_count() {  # wait (at most 60 s) until the counter writing $1 has counted past $2
    local deadline=$((SECONDS + 60))
    until [ "$(count "$1")" -gt "$2" ]; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "demo: the counter did not count past $2 within 60 s" >&2; exit 1; }
        sleep 0.1
    done
}
gone() {  # wait (at most 30 s) until process $1 has exited
    local deadline=$((SECONDS + 30))
    while kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" | cut -c1)" != Z ]; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "demo: process $1 is still there" >&2; exit 1; }
        sleep 0.1
    done
}

echo "== what this machine can do"
$g doctor
echo
echo "== start a process that counts and holds 256 MiB of state"
setsid python3 scripts/workloads/demo_counter.py "$work/count" </dev/null >/dev/null 2>&1 &
pid=$!
disown "$pid"  # CRIU ends it: no job-status noise from the shell
wait_count "$work/count" 5
echo "pid $pid, counted to $(count "$work/count")"
echo
echo "== checkpoint it into the store ($($g store --help >/dev/null; python3 -c 'from storage.repo.store import default_store_path as d; print(d())'))"
$g criu dump "$pid" "$name"
gone "$pid"
last=$(count "$work/count")
echo "the process is gone; it had counted to $last"
$g store ls
$g store inspect "$name"
echo
echo "== verify the snapshot, then restore it"
$g store verify "$name"
$g criu restore "$name"
wait_count "$work/count" "$((last + 3))"
now=$(count "$work/count")
echo "restored pid $pid counts on: $last -> $now"
digests=$(cut -d' ' -f2 "$work/count" | sort -u | wc -l)
[ "$digests" -eq 1 ] || { echo "demo: the process state changed across the restore" >&2; exit 1; }
kill "$pid"
gone "$pid"
echo
echo "== a second snapshot of the same state costs almost nothing (dedup), then clean up"
setsid python3 scripts/workloads/demo_counter.py "$work/count2" </dev/null >/dev/null 2>&1 &
pid2=$!
disown "$pid2"
wait_count "$work/count2" 2
$g criu dump --leave-running "$pid2" "$name-a"
$g criu dump --leave-running "$pid2" "$name-b"
kill "$pid2"
gone "$pid2"
$g store rm "$name" "$name-a" "$name-b"
$g store gc
echo "demo: OK"
