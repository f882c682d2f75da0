#!/usr/bin/env bash
# Idempotent setup on Debian 12: system packages (CRIU >= 4, runsc, iproute2, zstd), a virtual env in
# .venv with gpusnap installed editable with its dev extras. A second run with nothing changed takes
# about a second (stamp files in .cache/). Run as root for the system packages.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p .cache
export DEBIAN_FRONTEND=noninteractive

apt_pkgs=(python3-venv runsc iproute2 zstd tar procps util-linux)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then echo "setup: need root to install ${missing[*]}" >&2; exit 1; fi
    echo "setup: installing ${missing[*]}" >&2
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi

criu=$(scripts/install-criu.sh)
scripts/swift-setup.sh install  # the object store the remote-tier tests use (started by scripts/test.sh)
ln -sf "$criu" .cache/criu-bin

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$py" -m venv .venv; fi
stamp=.cache/venv.stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/pip install -q --upgrade pip >&2
    .venv/bin/pip install -q -e ".[dev]" >&2
    echo "$want" > "$stamp"
fi
echo "setup: ok (criu: $criu, runsc: $(command -v runsc), venv: $root/.venv)" >&2
