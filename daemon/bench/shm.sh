#!/usr/bin/env bash
# The table's own find in process against find through hkvd over a
# registered memfd (and over the socket), alternated in one run.
#   daemon/bench/shm.sh [rounds] [extra hkvd serve flags]
# Each round runs, one after the other:
#   hkv-bench --backend cpu --capacity 4194304 --dims 32 --batch 262144 --ops find --lambdas 0.5
#   hkvctl bench --capacity 4194304 --batches 262144 --clients 1 --transport socket,shm --json
# (a fresh hkvd each round), then prints every figure and the medians.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
shift || true
cargo build --release -q -p hkvd -p hkv-client -p hkv-shard --bin hkvd --bin hkvctl --bin hkv-bench
bin=target/release
tmp=$(mktemp -d)
cleanup() { [ -n "${hp:-}" ] && kill "$hp" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
echo "== $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$rounds"); do
    table=$("$bin/hkv-bench" --backend cpu --capacity 4194304 --dims 32 --batch 262144 --ops find --lambdas 0.5 --no-moka)
    # The find figure (B-KV/s) is the column named find in the table's row.
    kps=$(echo "$table" | awk '/find/ && !f { for (i = 1; i <= NF; i++) if ($i == "find") c = i; f = 1; next } f && c && $c ~ /^[0-9.]+$/ { print $c * 1e9; exit }')
    echo "round $r: in-process find $kps keys/s"
    echo "$table" > "$tmp/table.$r"
    rm -rf "$tmp/run"
    "$bin/hkvd" serve --backend cpu --socket "$tmp/run/hkvd.sock" --state-dir "$tmp/state" --log warn "$@" &
    hp=$!
    for _ in $(seq 100); do "$bin/hkvctl" --socket "$tmp/run/hkvd.sock" ping >/dev/null 2>&1 && break; sleep 0.1; done
    "$bin/hkvctl" --socket "$tmp/run/hkvd.sock" bench --capacity 4194304 --batches 262144 --clients 1 \
        --transport socket,shm --json | grep '^{' | tee "$tmp/hkvd.$r"
    kill "$hp"; wait "$hp" 2>/dev/null || true; hp=
    echo "$kps" >> "$tmp/inproc"
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$tmp" "$rounds" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
inproc = [float(x) for x in open(f"{tmp}/inproc").read().split()]
figs = {}
for r in range(1, rounds + 1):
    for line in open(f"{tmp}/hkvd.{r}"):
        f = json.loads(line)
        figs.setdefault((f["transport"], f["op"]), []).append(f["keys_per_s"])
med = statistics.median
print(f"in-process find: {', '.join(f'{x/1e6:.2f}' for x in inproc)} M keys/s, median {med(inproc)/1e6:.2f}")
for (t, o), v in sorted(figs.items()):
    print(f"{t:>10} {o:<17} {', '.join(f'{x/1e6:.2f}' for x in v)} M keys/s, median {med(v)/1e6:.2f}")
shm = med(figs[("shm", "find")])
print(f"shm find / in-process find (medians): {100 * shm / med(inproc):.0f} %")
PY
