#!/usr/bin/env bash
# What the GPU machine needs and cannot download (it has no network), built here into git-ignored
# folders to name in the device tool's `carry`:
#   .whl/          wheels for Python 3.12 (the GPU machine's), no dependencies resolved there;
#   .carry/criu/   this machine's CRIU (scripts/setup/install-criu.sh builds it once), every shared
#                  library ldd lists for it except glibc's, and criu-wrapper (LD_LIBRARY_PATH);
#   .carry-xz/criu.tar.xz  the same folder xz-packed (~3 MB instead of ~10): carry [".whl", ".carry-xz"]
#                  once the tree and .whl leave no room for the folder itself (device-run.sh unpacks it).
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
if [ ! -f .carry-xz/criu.tar.xz ]; then
  mkdir -p .carry-xz && tar -C .carry -cf - criu | xz -T2 -9 > .carry-xz/criu.tar.xz
fi
# .whl-lite/: .whl without nvCOMP's two wheels (WHEELS=.whl-lite for device-run.sh), and
# .tools/py-spy.xz (the `gilprof` mode's profiler, xz-packed: ~2 MB): room for both in the carry
if [ ! -d .whl-lite ]; then
  mkdir -p .whl-lite && cp .whl/*.whl .whl-lite/ && rm -f .whl-lite/nvidia_*nvcomp*
fi
# .whl-dev/: .whl without rich and its three (progress bars only on a terminal; none there): with the
# tree's ~13 MB, .whl (~50 MB with cuda-bindings 13.5 and nvCOMP 6.0) and .carry-xz no longer fit the
# 64 MiB carry; carry [".whl-dev", ".carry-xz"] with WHEELS=.whl-dev for the GPU suite and the benchmarks
if [ ! -d .whl-dev ]; then
  mkdir -p .whl-dev && cp .whl/*.whl .whl-dev/ && rm -f .whl-dev/{rich,pygments,markdown_it_py,mdurl}-*.whl
fi
if [ ! -f .tools/py-spy.xz ]; then
  tmp=$(mktemp -d)
  ${PYTHON:-python3} -m pip download -q --only-binary=:all: --no-deps --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$tmp" py-spy
  mkdir -p .tools
  ${PYTHON:-python3} - "$tmp" <<'P'
import glob, lzma, shutil, sys, zipfile
whl = glob.glob(sys.argv[1] + "/py_spy-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/py-spy"))
    with z.open(name) as f, lzma.open(".tools/py-spy.xz", "wb") as g:
        shutil.copyfileobj(f, g)
P
  rm -rf "$tmp"
fi
# .whl-serve/: what scripts/bench/bench_server.py's transformers server needs beside torch (there already):
# transformers and its own (no hf_xet: nothing is downloaded), aiohttp and its own, plus .whl-lite without
# rich and its three; with the tree and .carry-xz it fits the 64 MiB carry:
#   carry [".whl-serve", ".carry-xz"], WHEELS=.whl-serve device-run.sh server
if [ ! -d .whl-serve ]; then
  mkdir -p .whl-serve
  ${PYTHON:-python3} -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d .whl-serve transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2 safetensors regex pyyaml requests \
    urllib3 idna certifi charset_normalizer tqdm packaging filelock fsspec typing_extensions \
    aiohttp multidict yarl frozenlist aiosignal attrs propcache aiohappyeyeballs
  cp .whl-lite/*.whl .whl-serve/ && rm -f .whl-serve/{rich,pygments,markdown_it_py,mdurl}-*.whl
fi
du -sh .whl .whl-lite .whl-dev .whl-serve .carry .carry-xz .tools >&2
