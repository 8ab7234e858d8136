#!/bin/bash
# The cost of the live miss-ratio curves (daemon/BENCHMARKS.md): rounds of
# hkvctl bench against a CPU daemon with the curves on and with --no-mrc,
# the order alternating every round. Prints one JSON line per run.
# Usage: daemon/bench/mrc-cost.sh [ROUNDS] [extra hkvd serve flags...]
set -u
B=${HKVD_BIN_DIR:-$(dirname "$0")/../../target/release}
rounds=${1:-6}; shift || true
for round in $(seq "$rounds"); do
  order="on off"; [ $((round % 2)) = 0 ] && order="off on"
  for mode in $order; do
    d=$(mktemp -d)
    extra=(); [ "$mode" = off ] && extra=(--no-mrc)
    "$B/hkvd" serve --backend cpu --socket "$d/s.sock" --state-dir "$d/st" --log warn "${extra[@]}" "$@" & pid=$!
    for _ in $(seq 50); do [ -S "$d/s.sock" ] && break; sleep 0.1; done
    load=$(cut -d' ' -f1 /proc/loadavg)
    "$B/hkvctl" --socket "$d/s.sock" bench --dim 32 --capacity 1048576 --batches 65536 --clients 1 --seconds 2 --json \
      | grep '^{' | sed "s/^{/{\"mrc\":\"$mode\",\"round\":$round,\"load\":$load,/"
    kill "$pid"; wait "$pid" 2>/dev/null; rm -rf "$d"
  done
done
