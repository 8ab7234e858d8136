#!/usr/bin/env bash
# Resident memory of hkvd under a mixed load of valid and invalid frames,
# repeated: does what the daemon holds keep growing, or level off?
# Usage: daemon/bench/rss.sh [rounds=4] [seconds=30] [connections=6]
# Runs target/release/hkvd (CPU backend, 2 shards, frame cache off so that
# only the allocator's own retention shows), one table of 4 Mi slots of dim 16.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-4}; seconds=${2:-30}; conns=${3:-6}
d=$(mktemp -d); trap 'kill $pid 2>/dev/null; rm -rf "$d"' EXIT
target/release/hkvd serve --backend cpu --shards 2 --socket "$d/s.sock" --state-dir "$d/state" --log warn --frame-cache-bytes 0 &
pid=$!
until target/release/hkvctl --socket "$d/s.sock" ping >/dev/null 2>&1; do sleep 0.1; done
target/release/hkvctl --socket "$d/s.sock" create-table t --dim 16 --capacity 4194304 >/dev/null
rss() { awk '/VmRSS/ {print $2}' "/proc/$pid/status"; }
echo "start: $(rss) kB"
for i in $(seq "$rounds"); do
    python3 daemon/bench/mixed_load.py "$d/s.sock" "$seconds" "$conns"
    echo "after round $i: $(rss) kB"
done
sleep 20
echo "idle 20 s: $(rss) kB"
