#!/usr/bin/env bash
# Socket benchmark of hkvd beside the raw socket and Redis, on this machine.
#   daemon/bench/socket.sh [--redis-only|--hkvd-only] [extra hkvctl bench flags]
# Builds the release binaries, starts hkvd (CPU backend unless HKVD_BACKEND is
# set) on a temporary socket and runs `hkvctl bench` (find and
# insert_or_assign, dim 32, against the echo op moving the same bytes). Then
# installs redis-server if it is missing, starts it on a Unix socket with
# persistence off, stores 1 M 128-byte values and measures pipelined 100-key
# MGET and MSET with redis-benchmark (pipeline 16).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=all
case "${1:-}" in --redis-only) mode=redis; shift ;; --hkvd-only) mode=hkvd; shift ;; esac
tmp=$(mktemp -d)
cleanup() { [ -n "${hp:-}" ] && kill "$hp" 2>/dev/null; [ -n "${rp:-}" ] && kill "$rp" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

if [ "$mode" != redis ]; then
    cargo build --release -q -p hkvd -p hkv-client
    bin=target/release
    "$bin/hkvd" serve --backend "${HKVD_BACKEND:-cpu}" --socket "$tmp/hkvd.sock" --state-dir "$tmp/state" --log warn &
    hp=$!
    for _ in $(seq 100); do "$bin/hkvctl" --socket "$tmp/hkvd.sock" ping >/dev/null 2>&1 && break; sleep 0.1; done
    echo "== hkvd ($(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
    "$bin/hkvctl" --socket "$tmp/hkvd.sock" bench "$@"
    kill "$hp"; wait "$hp" 2>/dev/null || true; hp=
fi

if [ "$mode" != hkvd ]; then
    if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
        SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
    fi
    redis-server --port 0 --unixsocket "$tmp/redis.sock" --save "" --appendonly no --daemonize no >/dev/null &
    rp=$!
    for _ in $(seq 100); do redis-cli -s "$tmp/redis.sock" ping >/dev/null 2>&1 && break; sleep 0.1; done
    echo "== $(redis-server --version | cut -d' ' -f1-3)"
    redis-benchmark -s "$tmp/redis.sock" -q -t set -n 1000000 -r 1000000 -d 128 -P 64 | tr '\r' '\n' | grep -v '^$' | tail -1
    mget="MGET"; mset="MSET"
    val=$(head -c 128 /dev/zero | tr '\0' 'v')
    for _ in $(seq 100); do mget="$mget key:__rand_int__"; mset="$mset key:__rand_int__ $val"; done
    for cmd in mget mset; do
        line=$(redis-benchmark -s "$tmp/redis.sock" -q -n 200000 -r 1000000 -P 16 ${!cmd} | tr '\r' '\n' | grep -v '^$' | tail -1)
        rps=$(echo "$line" | sed -E 's/.*: ([0-9.]+) requests per second.*/\1/')
        echo "redis pipelined 100-key ${cmd^^} (128-byte values, pipeline 16): $rps requests/s = $(awk "BEGIN{printf \"%.0f\", $rps*100}") keys/s"
    done
fi
