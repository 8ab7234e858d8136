#!/usr/bin/env bash
# Checkpoint and restore throughput beside the disk's raw sequential write rate.
#   daemon/bench/checkpoint.sh [entries, default 10000000] [dim, default 32]
# Starts hkvd (CPU backend unless HKVD_BACKEND is set) with its state on the
# disk of this directory, fills a table, takes 3 full checkpoints, restarts to
# measure the restore, and writes the same number of bytes with dd 3 times
# (8 MiB blocks, fsync at the end) for the raw rate. Quote medians.
set -euo pipefail
cd "$(dirname "$0")/../.."
n=${1:-10000000}; dim=${2:-32}
cargo build --release -q -p hkvd -p hkv-client
bin=target/release
root=$(mktemp -d -p "$PWD" .ckbench.XXXX)
trap 'kill $hp 2>/dev/null || true; rm -rf "$root"' EXIT
sock="$root/hkvd.sock"
start() {
    "$bin/hkvd" serve --backend "${HKVD_BACKEND:-cpu}" --socket "$sock" --state-dir "$root/state" \
        --checkpoint-full-every 0 --log info 2>>"$root/log" &
    hp=$!
    for _ in $(seq 6000); do "$bin/hkvctl" --socket "$sock" ping >/dev/null 2>&1 && return; sleep 0.05; done
    echo "hkvd did not start" >&2; exit 1
}
start
cap=$(( n * 2 ))
"$bin/hkvctl" --socket "$sock" create-table bench --dim "$dim" --capacity "$cap" >/dev/null
"$bin/hkvctl" --socket "$sock" fill bench --count "$n"
echo "== checkpoint of $n entries, dim $dim ($(nproc) cores)"
for i in 1 2 3; do "$bin/hkvctl" --socket "$sock" checkpoint --wait --full; done
"$bin/hkvctl" --socket "$sock" checkpoints | head -2
kill "$hp"; wait "$hp" || true
du -sh "$root/state/checkpoints"; echo "files in the store: $(find "$root/state/checkpoints" -type f | wc -l)"
echo "== restore"
t0=$(date +%s.%N); start; t1=$(date +%s.%N)
grep "checkpoint restored" "$root/log" | tail -1 | sed 's/.*checkpoint restored/checkpoint restored/'
echo "daemon start with restore: $(awk "BEGIN{printf \"%.2f\", $t1-$t0}") s"
kill "$hp"; wait "$hp" || true; hp=
bytes=$(( n * (16 + 4 * dim) ))
echo "== raw sequential write of the same $(( bytes / 1048576 )) MiB (dd, 8 MiB blocks, fsync), 3 runs"
for i in 1 2 3; do
    dd if=/dev/zero of="$root/raw" bs=8M count=$(( bytes / 8388608 + 1 )) conv=fsync 2>&1 | tail -1
    rm -f "$root/raw"
done
