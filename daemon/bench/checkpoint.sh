#!/usr/bin/env bash
# Checkpoint and restore throughput beside the disk's raw sequential write rate.
#   daemon/bench/checkpoint.sh [entries, default 10000000] [dim, default 32]
# Starts hkvd (CPU backend unless HKVD_BACKEND is set) with its state on the
# disk of this directory, fills a table, then alternates 3 times: a full
# checkpoint, and `dd if=/dev/zero of=F bs=1M count=1024 oflag=direct
# conv=fsync` (the issue's raw write); then 3 restores (restart with restore)
# alternated with `dd if=F of=/dev/null bs=1M iflag=direct` (raw read).
# Quote medians. HKVD_BIN=PATH runs that hkvd binary (one built earlier, for
# a before / after comparison) instead of building this tree's; hkvctl is
# target/release's either way. HKVD_SERVE_ARGS adds `hkvd serve` flags
# (e.g. "--shards 4 --restore-readers 8"). HKVD_HUGE_PAGES=0 reaches the daemon (see
# `hkvd --help`). Each restore's "restore stages" log line is printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
n=${1:-10000000}; dim=${2:-32}
[ -n "${HKVD_BIN:-}" ] || cargo build --release -q -p hkvd -p hkv-client
bin=target/release
hkvd=${HKVD_BIN:-$bin/hkvd}
root=$(mktemp -d -p "$PWD" .ckbench.XXXX)
trap 'kill $hp 2>/dev/null || true; rm -rf "$root"' EXIT
sock="$root/hkvd.sock"
start() {
    "$hkvd" serve --backend "${HKVD_BACKEND:-cpu}" --socket "$sock" --state-dir "$root/state" \
        --checkpoint-full-every 0 --log info ${HKVD_SERVE_ARGS:-} 2>>"$root/log" &
    hp=$!
    for _ in $(seq 6000); do "$bin/hkvctl" --socket "$sock" ping >/dev/null 2>&1 && return; sleep 0.05; done
    echo "hkvd did not start" >&2; exit 1
}
start
cap=$(( n * 2 ))
"$bin/hkvctl" --socket "$sock" create-table bench --dim "$dim" --capacity "$cap" >/dev/null
"$bin/hkvctl" --socket "$sock" fill bench --count "$n"
echo "== checkpoint of $n entries, dim $dim ($(nproc) cores), alternated with dd"
for i in 1 2 3; do
    "$bin/hkvctl" --socket "$sock" checkpoint --wait --full
    dd if=/dev/zero of="$root/raw" bs=1M count=1024 oflag=direct conv=fsync 2>&1 | tail -1
done
"$bin/hkvctl" --socket "$sock" checkpoints | sed -n 1,2p
kill "$hp"; wait "$hp" || true
du -sh "$root/state/checkpoints"
echo "== restore (restart with restore), alternated with dd read"
for i in 1 2 3; do
    sync; echo 3 2>/dev/null > /proc/sys/vm/drop_caches || true
    t0=$(date +%s.%N); start; t1=$(date +%s.%N)
    grep "checkpoint restored" "$root/log" | tail -1 | sed 's/.*checkpoint restored/checkpoint restored/'
    grep "restore stages" "$root/log" | tail -1 | sed 's/.*restore stages[^)]*)//' || true
    echo "daemon start with restore: $(awk "BEGIN{printf \"%.2f\", $t1-$t0}") s"
    kill "$hp"; wait "$hp" || true; hp=
    dd if="$root/raw" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1
done
