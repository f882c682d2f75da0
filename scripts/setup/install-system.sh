#!/usr/bin/env bash
# gpusnap installed as software (what scripts/setup.sh runs as root): a virtual env made from the
# system's python3 at PREFIX (default /opt/gpusnap) with gpusnap installed from a copy of this tree
# (not editable: the checkout can go), its commands linked into BINDIR (default /usr/local/bin), and
# the CRIU given copied to PREFIX/libexec/criu and linked as SBINDIR/criu (default /usr/local/sbin)
# when nothing is there yet. Idempotent; redone only when the package's files change (a stamp over
# their names, sizes and modification times, kept in PREFIX). Progress on stderr.
#   scripts/setup/install-system.sh [--python PY] [--prefix DIR] [--bindir DIR] [--sbindir DIR] [--criu PATH]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=/usr/bin/python3; prefix=/opt/gpusnap; bindir=/usr/local/bin; sbindir=/usr/local/sbin; criu=
while [ $# -gt 0 ]; do
    case $1 in
        --python) py=$2 ;; --prefix) prefix=$2 ;; --bindir) bindir=$2 ;; --sbindir) sbindir=$2 ;;
        --criu) criu=$2 ;;
        *) echo "install-system: unknown option $1" >&2; exit 2 ;;
    esac
    shift 2
done
cd "$root"
want=$( { echo "$py $prefix"; find pyproject.toml README.md cli agents criu_hooks sandbox storage \
          -name __pycache__ -prune -o -type f -printf '%p %s %T@\n' | sort; } | sha256sum | cut -d' ' -f1)
stamp=$prefix/.gpusnap-install.stamp
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$prefix/bin/gpusnap" ]; then
    [ -x "$prefix/bin/python" ] || "$py" -m venv "$prefix"
    # from a copy of the package's files (pip would build in the tree and leave build/ there); nothing
    # installed points back here
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    cp -r pyproject.toml README.md cli agents criu_hooks sandbox storage "$src/"
    find "$src" -name __pycache__ -prune -exec rm -rf {} +
    "$prefix/bin/pip" install -q --no-warn-script-location "$src"
    "$prefix/bin/pip" install -q --no-warn-script-location --no-deps --force-reinstall "$src"
    chmod -R go-w "$prefix"
    echo "$want" > "$stamp"
fi
# the commands run isolated, as the CRIU hook that `hook install` writes does: -I (no PYTHON* variables,
# no user site-packages, neither the current directory nor the script's on sys.path) and -S (no site
# module: no sitecustomize/usercustomize or .pth file runs); sys.path gets the env's own site-packages,
# named here. pip's launchers honoured PYTHONPATH: a sitecustomize.py planted there ran as root.
"$prefix/bin/python" -I - "$prefix" <<'PY'
import os, site as _site, sys
prefix = sys.argv[1]
site = [p for p in _site.getsitepackages() if p.startswith(os.path.realpath(prefix) + "/") or p.startswith(prefix + "/")]
for name, mod, fn in (("gpusnap", "cli", "main"), ("gpusnap-criu-hook", "criu_hooks.action_script", "main")):
    text = (f"#!{prefix}/bin/python -IS\n# gpusnap's {name}, isolated (scripts/setup/install-system.sh)\n"
            f"import sys\nsys.path[:0] = {site!r}\nfrom {mod} import {fn}\nsys.exit({fn}())\n")
    path = os.path.join(prefix, "bin", name)
    try:
        with open(path) as f:
            if f.read() == text:
                continue
    except OSError:
        pass
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
PY
mkdir -p "$bindir"
for c in gpusnap gpusnap-criu-hook; do ln -sfn "$prefix/bin/$c" "$bindir/$c"; done
if [ -n "$criu" ]; then
    mkdir -p "$prefix/libexec"
    cmp -s "$criu" "$prefix/libexec/criu" || install -m 0755 "$criu" "$prefix/libexec/criu"
    if [ ! -e "$sbindir/criu" ] && [ ! -L "$sbindir/criu" ]; then
        mkdir -p "$sbindir" && ln -s "$prefix/libexec/criu" "$sbindir/criu"
    fi
fi
echo "$bindir/gpusnap"
