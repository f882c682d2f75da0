#!/usr/bin/env bash
# What the GPU machine needs and cannot download (it has no network), built here into two git-ignored
# folders to name in the device tool's `carry`:
#   .whl/          wheels for Python 3.12 (the GPU machine's), no dependencies resolved there;
#   .carry/criu/   this machine's CRIU (scripts/setup/install-criu.sh builds it once), every shared
#                  library ldd lists for it except glibc's, and criu-wrapper (LD_LIBRARY_PATH).
# Idempotent: a folder already there is kept (delete it to rebuild). Prints the two sizes.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
if [ ! -d .whl ] || [ -z "$(ls .whl 2>/dev/null)" ]; then
  mkdir -p .whl
  py=${PYTHON:-python3}
  $py -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d .whl zstandard blake3 click rich markdown-it-py mdurl pygments pyroute2 \
    nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13 cuda-bindings cuda-pathfinder
fi
if [ ! -x .carry/criu/criu-wrapper ]; then
  criu=${CRIU:-$(bash scripts/setup/install-criu.sh)}  # CRIU=path: one built already
  mkdir -p .carry/criu/lib
  cp "$criu" .carry/criu/criu
  strip .carry/criu/criu 2>/dev/null || true
  ldd "$criu" | awk '/=> \//{print $3}' | grep -v -E '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' \
    | while read -r lib; do cp -L "$lib" .carry/criu/lib/; done
  cat > .carry/criu/criu-wrapper <<'W'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/criu" "$@"
W
  chmod +x .carry/criu/criu-wrapper
  .carry/criu/criu-wrapper --version >&2
fi
du -sh .whl .carry >&2
