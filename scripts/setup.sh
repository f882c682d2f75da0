#!/usr/bin/env bash
# Idempotent setup on Debian 12: system packages (CRIU >= 4, runsc, runc, Podman, busybox-static for
# container tests, iproute2, zstd), a virtual env in .venv (made from the system's python3, not
# whatever python3 is first on PATH) with gpusnap installed editable with its dev extras, and, as root,
# gpusnap installed as software (scripts/setup/install-system.sh): a copy (not editable) in the system
# venv /opt/gpusnap, its commands linked as /usr/local/bin/gpusnap and /usr/local/bin/gpusnap-criu-hook,
# and the CRIU built here copied to /opt/gpusnap/libexec/criu (linked as /usr/local/sbin/criu when
# nothing is there yet), so that `gpusnap` works for every user and outlives this checkout. A second run with nothing changed takes
# about a second (stamp files in .cache/). Run as root for the system packages and the system install.
# Quiet: one summary line; every step's output goes to .cache/setup.log, shown in full if a step fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p .cache
export DEBIAN_FRONTEND=noninteractive
log=.cache/setup.log
: > "$log"
t0=$SECONDS

step() {  # step WHAT CMD...: run CMD with its output in the log; on failure show the log and stop
    local what=$1
    shift
    echo "== $what: $*" >> "$log"
    if ! "$@" >> "$log" 2>&1; then
        echo "setup: $what failed; the whole log ($root/$log):" >&2
        cat "$log" >&2
        exit 1
    fi
}

# wait up to 5 minutes for another apt/dpkg run (unattended-upgrades, a parallel setup) to finish
apt=(apt-get -q -o DPkg::Lock::Timeout=300)
# runc and Podman (with runc as its runtime: crun is not installed, Debian 12's has no CRIU support) and
# busybox-static (the containers' root filesystem: no image registry is needed) for the container tests.
# acl: setfacl/getfacl, for the tests that store and restore POSIX ACLs. python3-yaml: CRIU's zdtm (scripts/zdtm/).
apt_pkgs=(python3-venv runsc iproute2 zstd tar procps util-linux runc podman conmon
          golang-github-containers-common containernetworking-plugins busybox-static strace acl python3-yaml)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then echo "setup: need root to install ${missing[*]}" >&2; exit 1; fi
    echo "setup: installing ${missing[*]} (log: $log)" >&2
    step "apt-get update" "${apt[@]}" update
    step "apt-get install" "${apt[@]}" install -y --no-install-recommends "${missing[@]}"
fi

scripts/setup/install-criu.sh --check >/dev/null 2>&1 || echo "setup: building CRIU (once, about a minute; log: $log)" >&2
step "CRIU" sh -c 'scripts/setup/install-criu.sh > .cache/criu-path'
criu=$(cat .cache/criu-path)
step "Swift" scripts/setup/swift-setup.sh install  # the object store the remote-tier tests use (started by scripts/test.sh)
ln -sf "$criu" .cache/criu-bin

# The system's python3 (Debian's, with python3-venv): a pyenv or other python first on PATH may be
# unreadable to other users and is not what the system install should depend on. PYTHON= overrides.
py=${PYTHON:-/usr/bin/python3}
[ -x "$py" ] || py=$(command -v python3)
# a .venv made from another python (pyenv's, say) is made again from this one
venv_home=$(sed -n 's/^home *= *//p' .venv/pyvenv.cfg 2>/dev/null || true)
if [ ! -x .venv/bin/python ] || [ "$venv_home" != "$(dirname "$py")" ]; then
    rm -rf .venv
    step "venv" "$py" -m venv .venv
    rm -f .cache/venv.stamp
fi
stamp=.cache/venv.stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    step "pip" .venv/bin/pip install -q --upgrade pip
    step "pip" .venv/bin/pip install -q -e ".[dev]"
    echo "$want" > "$stamp"
fi

# torch, transformers, safetensors and aiohttp for the workload tests (tests/test_workload_helper.py,
# tests/test_transformers_server.py, tests/test_swap_gpu.py: a small
# real transformers model served on the CPU). torch==2.13.0 is pinned because pip takes its CPU build
# (about 190 MB, no CUDA libraries) from this machine kind's local wheel directory; a newer release
# would pull a CUDA build of several GB. Measured here on a fresh venv: 37 s, 1.1 GB (torch alone 0.75 GB).
# GPUSNAP_NO_TORCH=1 skips it (those tests then skip, saying why). Stamped: once per pin.
torch_pins="torch==2.13.0 transformers==4.57.6 safetensors==0.8.0 aiohttp==3.14.5"
if [ "${GPUSNAP_NO_TORCH:-0}" != 1 ] && [ "$(cat .cache/torch.stamp 2>/dev/null)" != "$torch_pins" ]; then
    echo "setup: installing $torch_pins into .venv (once; log: $log)" >&2
    # shellcheck disable=SC2086 - the pins are words
    step "pip torch" .venv/bin/pip install -q $torch_pins
    echo "$torch_pins" > .cache/torch.stamp
fi

# the native helpers (storage/native/build.py: the byte planes, the delta page counts and the dump's pipe
# reads in C); without a compiler gpusnap uses numpy and Python in their place, so a failure here is a
# line, not a stop
if ! .venv/bin/python -m storage.native.build >> "$log" 2>&1; then
    echo "setup: storage/native not built (no C compiler?): numpy and Python do its work (log: $log)" >&2
fi

# gpusnap as software, for every user (root only): /opt/gpusnap, /usr/local/bin/gpusnap (install-system.sh)
if [ "$(id -u)" -eq 0 ]; then
    step "system install" sh -c "scripts/setup/install-system.sh --python '$py' --criu '$criu' > .cache/gpusnap-path"
    on_path=$(cat .cache/gpusnap-path)
else
    on_path="not installed system-wide (run as root); use $root/.venv/bin/gpusnap"
fi
echo "setup: ok in $((SECONDS - t0)) s (criu $("$criu" --version | sed -n 's/^Version: *//p') at $criu," \
     "runsc $(command -v runsc), dev venv $root/.venv, gpusnap on PATH: $on_path; log $root/$log)" >&2
