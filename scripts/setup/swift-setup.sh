#!/usr/bin/env bash
# A one-node OpenStack Swift (Debian 12's 2.30) with its S3 API on 127.0.0.1, for the remote-tier tests
# and benchmarks: installs the packages if missing, writes configs and rings under one state directory,
# starts the four servers in the background with pid files, and waits until every /healthcheck answers.
# Idempotent: a second `start` with the servers up only checks their health. Prints the S3 endpoint.
#
#   scripts/setup/swift-setup.sh [start|install|stop|status]   (install: packages and configs, no servers)
#   GPUSNAP_SWIFT_DIR   state directory (default /var/lib/gpusnap-swift): configs, rings, data, logs, pids
#   GPUSNAP_SWIFT_PORT  proxy port (default 18480); the account/container/object servers take the next
#                       three, memcached (the proxy's cache of account/container info) the fourth
# S3 access: path-style, region us-east-1, SigV4, access key "test:tester", secret "testing".
set -euo pipefail
action=${1:-start}
dir=${GPUSNAP_SWIFT_DIR:-/var/lib/gpusnap-swift}
port=${GPUSNAP_SWIFT_PORT:-18480}
acct=$((port + 1)) cont=$((port + 2)) obj=$((port + 3)) mc=$((port + 4))
servers=(account container object proxy)
export DEBIAN_FRONTEND=noninteractive

port_of() {
    case $1 in account) echo $acct ;; container) echo $cont ;; object) echo $obj ;; proxy) echo $port ;; esac
}

healthy() {  # healthy SERVER: its /healthcheck answers OK
    python3 - "$(port_of "$1")" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthcheck", timeout=2) as r:
    sys.exit(0 if r.read().strip() == b"OK" else 1)
EOF
}

running() {  # running SERVER: its pid file names a live process that is that server of this instance
    local pf="$dir/run/$1.pid" cmd
    [ -f "$pf" ] || return 1
    cmd=$(tr '\0' ' ' < "/proc/$(cat "$pf")/cmdline" 2>/dev/null) || return 1
    case $1 in
        memcached) [[ $cmd == *"memcached "*"-p $mc "* ]] ;;
        *) [[ $cmd == *"swift-$1-server $dir/etc/"* ]] ;;
    esac
}

stop_all() {
    for s in "${servers[@]}" memcached; do
        local pf="$dir/run/$s.pid"
        [ -f "$pf" ] || continue
        # a pid file left from an earlier boot may name someone else's process now: never signal that
        if ! running "$s"; then rm -f "$pf"; continue; fi
        local pid
        pid=$(cat "$pf")
        # the servers call setsid: the pid is its process group (parent and workers)
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$pid" 2>/dev/null || true
        rm -f "$pf"
    done
}

install_packages() {
    local pkgs=(swift swift-proxy swift-account swift-container swift-object python3-swift memcached) missing=()
    for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" -ne 0 ]; then echo "swift-setup: need root to install ${missing[*]}" >&2; exit 1; fi
    apt-get update -q >&2
    apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}" >&2
}

write_configs() {
    mkdir -p "$dir/etc" "$dir/srv/d1" "$dir/run" "$dir/log" /etc/swift
    # Swift 2.30 reads /etc/swift/swift.conf whatever swift_dir says; keep one that is already there
    # (Debian's package ships one: its hash suffix and default policy serve a test instance as well)
    if [ ! -f /etc/swift/swift.conf ]; then
        cat > /etc/swift/swift.conf <<EOF
[swift-hash]
swift_hash_path_suffix = gpusnap-dev-suffix
swift_hash_path_prefix = gpusnap-dev-prefix

[storage-policy:0]
name = Policy-0
default = yes

[swift-constraints]
# S3 allows 2 KB of user metadata; more than ext4's xattr room (~3.5 KB with the key) fails as 507
max_meta_overall_size = 2048
EOF
    fi
    local common="bind_ip = 127.0.0.1
swift_dir = $dir/etc
devices = $dir/srv
mount_check = false
user = root
workers = 1
log_name = gpusnap-swift"
    for s in account container object; do
        cat > "$dir/etc/$s-server.conf" <<EOF
[DEFAULT]
$common
bind_port = $(port_of $s)
network_chunk_size = 1048576
disk_chunk_size = 1048576

[pipeline:main]
pipeline = healthcheck $s-server

[app:$s-server]
use = egg:swift#$s

[filter:healthcheck]
use = egg:swift#healthcheck
EOF
    done
    cat > "$dir/etc/proxy-server.conf" <<EOF
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = $port
swift_dir = $dir/etc
user = root
workers = 2
log_name = gpusnap-swift-proxy

[pipeline:main]
# slo: without it s3api turns multipart uploads off; symlink: needed by object versioning
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth copy slo dlo symlink proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true
allow_account_management = true
# one node: without this, one 507 marks the node bad and everything answers 503 for 60 s
error_suppression_interval = 0
object_chunk_size = 1048576
client_chunk_size = 1048576
node_timeout = 60
conn_timeout = 2

[filter:s3api]
use = egg:swift#s3api
location = us-east-1

[filter:tempauth]
use = egg:swift#tempauth
user_test_tester = testing .admin

[filter:catch_errors]
use = egg:swift#catch_errors
[filter:gatekeeper]
use = egg:swift#gatekeeper
[filter:healthcheck]
use = egg:swift#healthcheck
[filter:proxy-logging]
use = egg:swift#proxy_logging
[filter:cache]
use = egg:swift#memcache
memcache_servers = 127.0.0.1:$mc
# the default (2 connections per worker) times out under parallel requests and then error-limits
memcache_max_connections = 32
connect_timeout = 1
pool_timeout = 2
[filter:listing_formats]
use = egg:swift#listing_formats
[filter:copy]
use = egg:swift#copy
[filter:slo]
use = egg:swift#slo
[filter:dlo]
use = egg:swift#dlo
[filter:symlink]
use = egg:swift#symlink
EOF
    for s in account container object; do
        [ -f "$dir/etc/$s.ring.gz" ] && continue
        local b="$dir/etc/$s.builder"
        rm -f "$b"
        swift-ring-builder "$b" create 8 1 1 >/dev/null
        swift-ring-builder "$b" add "r1z1-127.0.0.1:$(port_of $s)/d1" 100 >/dev/null
        swift-ring-builder "$b" rebalance >/dev/null || [ $? -eq 1 ]  # 1 = a warning (one device)
    done
}

start_all() {
    if ! running memcached; then
        setsid memcached -u root -l 127.0.0.1 -p "$mc" -U 0 -m 64 >>"$dir/log/memcached.log" 2>&1 </dev/null &
        echo $! > "$dir/run/memcached.pid"
    fi
    for s in account container object proxy; do
        if running "$s"; then continue; fi
        # -v: log to stderr (there is no /dev/log here); the server setsid()s itself
        setsid "swift-$s-server" "$dir/etc/$s-server.conf" -v >>"$dir/log/$s.log" 2>&1 </dev/null &
        echo $! > "$dir/run/$s.pid"
    done
    for _ in $(seq 150); do
        local ok=1
        for s in "${servers[@]}"; do healthy "$s" || { ok=0; break; }; done
        [ $ok -eq 1 ] && return 0
        sleep 0.2
    done
    echo "swift-setup: Swift did not become healthy in 30 s; logs in $dir/log/" >&2
    exit 1
}

case $action in
    start)
        all_up=1
        running memcached || all_up=0
        for s in "${servers[@]}"; do { running "$s" && healthy "$s"; } || { all_up=0; break; }; done
        if [ $all_up -eq 0 ]; then
            install_packages
            stop_all
            write_configs
            start_all
        fi
        echo "http://127.0.0.1:$port"
        ;;
    install) install_packages; write_configs ;;
    stop) stop_all ;;
    status)
        for s in "${servers[@]}"; do
            if running "$s" && healthy "$s"; then echo "$s: up"; else echo "$s: down"; fi
        done
        ;;
    *) echo "usage: $0 [start|install|stop|status]" >&2; exit 2 ;;
esac
