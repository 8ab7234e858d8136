#!/bin/bash
# Alternates two hkvd binaries on the CPU backend, each round a fresh daemon of each:
# one-key socket find (requests/s) and 64 Ki-key find (keys/s), hkvctl bench --json lines.
# usage: daemon/bench/alternate_find.sh OLD_HKVD NEW_HKVD HKVCTL [ROUNDS]
old=$1; new=$2; ctl=$3; rounds=${4:-5}
for r in $(seq 1 $rounds); do
  for which in old new; do
    bin=${!which}
    d=$(mktemp -d); sock=$d/s.sock
    $bin serve --socket $sock --state-dir $d/state --no-mrc >$d/log 2>&1 &
    pid=$!
    for i in $(seq 50); do [ -S $sock ] && break; sleep 0.1; done
    $ctl bench --socket $sock --batches 1 --clients 1 --pipeline 1 --seconds 2 --warmup 0.5 --json 2>/dev/null | grep '"find"' | sed "s/^/$which r$r /"
    $ctl bench --socket $sock --batches 65536 --clients 1 --pipeline 2 --seconds 2 --warmup 0.5 --json 2>/dev/null | grep '"find"' | sed "s/^/$which r$r /"
    kill $pid; wait $pid 2>/dev/null; rm -rf $d
  done
done
