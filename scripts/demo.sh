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
name=demo-$(date +%H%M%S)
work=$(mktemp -d /tmp/gpusnap-demo.XXXXXX)
trap 'rm -rf "$work"' EXIT

echo "== what this machine can do"
$g doctor
echo
echo "== start a process that counts and holds 256 MiB of state"
setsid python3 scripts/workloads/demo_counter.py "$work/count" </dev/null >/dev/null 2>&1 &
pid=$!
sleep 2
echo "pid $pid, counted to $(tail -n1 "$work/count" | cut -d' ' -f1)"
echo
echo "== checkpoint it into the store ($($g store --help >/dev/null; python3 -c 'from storage.store import default_store_path as d; print(d())'))"
$g criu dump "$pid" "$name"
wait "$pid" 2>/dev/null || true
last=$(tail -n1 "$work/count" | cut -d' ' -f1)
sleep 1
kill -0 "$pid" 2>/dev/null && { echo "demo: the process should be gone" >&2; exit 1; }
echo "the process is gone; it had counted to $last"
$g store ls
$g store inspect "$name"
echo
echo "== verify the snapshot, then restore it"
$g store verify "$name"
$g criu restore "$name"
sleep 1.5
now=$(tail -n1 "$work/count" | cut -d' ' -f1)
echo "restored pid $pid counts on: $last -> $now"
[ "$now" -gt "$last" ] || { echo "demo: the restored process did not continue" >&2; exit 1; }
digests=$(cut -d' ' -f2 "$work/count" | sort -u | wc -l)
[ "$digests" -eq 1 ] || { echo "demo: the process state changed across the restore" >&2; exit 1; }
kill "$pid"
echo
echo "== a second snapshot of the same state costs almost nothing (dedup), then clean up"
setsid python3 scripts/workloads/demo_counter.py "$work/count2" </dev/null >/dev/null 2>&1 &
pid2=$!
sleep 1
$g criu dump --leave-running "$pid2" "$name-a"
$g criu dump --leave-running "$pid2" "$name-b"
kill "$pid2"
$g store rm "$name" "$name-a" "$name-b"
$g store gc
echo "demo: OK"
