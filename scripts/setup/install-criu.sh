#!/usr/bin/env bash
# Install a CRIU that works on the running kernel: the system's if it is new enough and `criu check`
# passes, else build it from Debian unstable's source package. Bookworm's CRIU 3.17 fails `criu check`
# on recent kernels, and CRIU 4.1.x passes `criu check` on kernels >= 6.16 but cannot dump any TCP
# socket there (6.16 restricted SO_PASSCRED/SO_PASSSEC to AF_UNIX/netlink; fixed in CRIU 4.2):
# docs/PLATFORM.md. The built binary is cached under .cache/criu so a second run is instant. Prints the
# path of the criu to use on stdout; progress on stderr. With --check: exit 0 if one is there, 1 if it
# would have to be built.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cache="$root/.cache/criu"
# The oldest CRIU that works on this kernel, as MAJOR*100+MINOR (kernel >= 6.16 needs 4.2).
kmaj=$(uname -r | cut -d. -f1); kmin=$(uname -r | cut -d. -f2 | sed 's/[^0-9].*//')
if [ $((kmaj * 100 + kmin)) -ge 616 ]; then want=402; else want=400; fi
suite=${GPUSNAP_CRIU_SUITE:-sid}

usable() {  # $1 = criu binary
    local v
    v=$("$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p') || return 1
    [ -n "$v" ] || return 1
    set -- "$1" $v
    [ $(($2 * 100 + $3)) -ge "$want" ] && "$1" check >/dev/null 2>&1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# CRIU's source (the upstream tarball of Debian $suite's package), unpacked in $srcs/criu-VERSION and kept
# there (scripts/zdtm/run.sh builds CRIU's own test suite from it); prints that directory.
srcs=${GPUSNAP_CRIU_SRC_CACHE:-$cache/src}
fetch_source() {
    local have
    have=$(ls -d "$srcs"/criu-*/ 2>/dev/null | head -n1 || true)
    if [ -n "$have" ] && [ -f "$have/Makefile" ]; then echo "${have%/}"; return 0; fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q -o DPkg::Lock::Timeout=300 --no-install-recommends libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev \
        protobuf-compiler libnl-3-dev libnl-route-3-dev libnet1-dev libcap-dev libnftables-dev libgnutls28-dev libbsd-dev \
        pkg-config python3-protobuf uuid-dev libaio-dev iproute2 xz-utils gcc make >&2
    # The mirror is whatever this machine's own apt configuration names; never a hard-coded host.
    mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | grep -v security | head -n1)
    [ -n "$mirror" ] || mirror=$(awk '$1=="deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
    echo "deb-src $mirror $suite main" > "$work/src.list"
    opts=(-o Dir::Etc::sourcelist="$work/src.list" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$work/lists")
    mkdir -p "$work/lists/partial"
    apt-get "${opts[@]}" update >&2
    # Only the upstream tarball (criu_*.orig.tar.*) is used; mirrors that lack the .dsc or the Debian
    # patch tarball answer 404 for those, which is harmless: those lines are left out.
    (cd "$work" && apt-get "${opts[@]}" source --download-only criu 2>&1 || true) |
        grep -v -E '404 +Not Found|^Err:.* criu .*\((dsc|diff)\)|^E: Failed to fetch .*criu_.*\.(dsc|debian\.tar\.xz)|^E: Failed to fetch some archives' >&2 || true
    orig=$(ls "$work"/criu_*.orig.tar.* 2>/dev/null | head -n1)
    [ -n "$orig" ] || { echo "install-criu: the CRIU source tarball could not be downloaded (see above)" >&2; exit 1; }
    mkdir -p "$srcs"
    local ver
    ver=$(basename "$orig" | sed 's/^criu_\(.*\)\.orig\.tar\..*$/\1/')
    rm -rf "$srcs/criu-$ver.tmp" && mkdir "$srcs/criu-$ver.tmp"
    tar -C "$srcs/criu-$ver.tmp" --strip-components=1 -xf "$orig"
    mv "$srcs/criu-$ver.tmp" "$srcs/criu-$ver"
    echo "$srcs/criu-$ver"
}

# --source: only fetch (once) and print CRIU's source directory ($GPUSNAP_CRIU_SRC_CACHE, default .cache/criu/src)
if [ "${1:-}" = "--source" ]; then fetch_source; exit 0; fi

if command -v criu >/dev/null && usable "$(command -v criu)"; then command -v criu; exit 0; fi
if [ -x "$cache/bin/criu" ] && usable "$cache/bin/criu"; then echo "$cache/bin/criu"; exit 0; fi
# --check: only say (exit status) whether a usable CRIU is there already; build nothing
if [ "${1:-}" = "--check" ]; then exit 1; fi

src=$(fetch_source)
make -C "$src" -j"$(nproc)" criu >&2
mkdir -p "$cache/bin"
install -m 0755 "$src/criu/criu" "$cache/bin/criu"
usable "$cache/bin/criu" || { echo "built criu does not pass 'criu check'" >&2; exit 1; }
echo "$cache/bin/criu"
