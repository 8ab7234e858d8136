#!/usr/bin/env bash
# On a GPU host: the table's own find in process on device batches against
# find through hkvd (CUDA backend) over CUDA IPC, shared memory and the
# socket, alternated in one run.
#   daemon/bench/cuda_ipc.sh [rounds] [extra hkvd serve flags]
# Each round runs, one after the other:
#   hkv-bench --backend cuda --key-mix hits --capacity 4194304 --dims 32 --batch B --ops find --lambdas 0.5
#     for B = 262144 and 1048576
#   hkvctl bench --capacity 4194304 --batches 262144,1048576 --clients 1,4 \
#     --transport socket,shm,cuda-ipc --json
#   (a fresh `hkvd serve --backend cuda` each round), then prints the medians
#   per (transport, op, batch, clients) and cuda-ipc find over the in-process find.
# Binaries: $HKVD_BIN, $HKVCTL_BIN, $HKV_BENCH_BIN (default target/release/...;
# built with cargo when none is set and cargo is there). $SECONDS_PER_FIGURE
# (default 1.5, after 0.5 s warm-up) sets hkvctl's time per figure: with 3
# rounds the run takes about 4 to 5 minutes.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
rounds=${1:-3}
shift || true
if [ -z "${HKVD_BIN:-}${HKVCTL_BIN:-}${HKV_BENCH_BIN:-}" ] && command -v cargo >/dev/null; then
    (cd "$root" && cargo build --release -q -p hkvd -p hkv-client -p hkv-shard --bin hkvd --bin hkvctl --bin hkv-bench)
fi
hkvd=${HKVD_BIN:-$root/target/release/hkvd}
hkvctl=${HKVCTL_BIN:-$root/target/release/hkvctl}
hkv_bench=${HKV_BENCH_BIN:-$root/target/release/hkv-bench}
secs=${SECONDS_PER_FIGURE:-1.5}
tmp=$(mktemp -d)
# One kernel cache for every process of the run: the first start compiles.
export HKV_KERNEL_CACHE=${HKV_KERNEL_CACHE:-$tmp/kernels}
cleanup() { [ -n "${hp:-}" ] && kill "$hp" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1); $(nproc) cores; load: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
for r in $(seq "$rounds"); do
    for b in 262144 1048576; do
        table=$("$hkv_bench" --backend cuda --key-mix hits --capacity 4194304 --dims 32 --batch "$b" --ops find --lambdas 0.5 --no-moka)
        # The find figure (B-KV/s) is the column named find in the table's row.
        kps=$(echo "$table" | awk '/find/ && !f { for (i = 1; i <= NF; i++) if ($i == "find") c = i; f = 1; next } f && c && $c ~ /^[0-9.]+$/ { print $c * 1e9; exit }')
        echo "round $r: in-process find, batch $b: $kps keys/s"
        echo "$b $kps" >> "$tmp/inproc"
    done
    rm -rf "$tmp/run" "$tmp/state"
    "$hkvd" serve --backend cuda --socket "$tmp/run/hkvd.sock" --state-dir "$tmp/state" --log warn "$@" &
    hp=$!
    for _ in $(seq 600); do "$hkvctl" --socket "$tmp/run/hkvd.sock" ping >/dev/null 2>&1 && break; sleep 0.1; done
    "$hkvctl" --socket "$tmp/run/hkvd.sock" bench --capacity 4194304 --batches 262144,1048576 --clients 1,4 \
        --seconds "$secs" --warmup 0.5 --transport socket,shm,cuda-ipc --json | grep '^{' | tee "$tmp/hkvd.$r"
    kill "$hp"; wait "$hp" 2>/dev/null || true; hp=
done
echo "$(( $(date +%s) - start )) s; load: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$tmp" "$rounds" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
med = statistics.median
inproc = {}
for line in open(f"{tmp}/inproc"):
    b, kps = line.split()
    inproc.setdefault(int(b), []).append(float(kps))
figs = {}
for r in range(1, rounds + 1):
    for line in open(f"{tmp}/hkvd.{r}"):
        f = json.loads(line)
        figs.setdefault((f["transport"], f["op"], f["batch"], f["clients"]), []).append((f["keys_per_s"], f["bytes_per_s"]))
print(f"{'transport':>10} {'op':<17} {'batch':>8} {'clients':>7} {'M keys/s (each round)':>32} {'median':>9} {'GB/s':>7}")
for b, v in sorted(inproc.items()):
    each = ", ".join(f"{x/1e6:.0f}" for x in v)
    print(f"{'in-process':>10} {'find':<17} {b:>8} {'-':>7} {each:>32} {med(v)/1e6:>9.1f} {'':>7}")
for (t, o, b, c), v in sorted(figs.items()):
    each = ", ".join(f"{x[0]/1e6:.1f}" for x in v)
    print(f"{t:>10} {o:<17} {b:>8} {c:>7} {each:>32} {med(x[0] for x in v)/1e6:>9.1f} {med(x[1] for x in v)/1e9:>7.2f}")
print()
for (t, o, b, c), v in sorted(figs.items()):
    if o != "find" or b not in inproc:
        continue
    ratio = med(x[0] for x in v) / med(inproc[b])
    extra = ""
    if t == "cuda-ipc":
        bar = 0.5 if c == 1 else 0.8
        extra = f"  (issue's bar: {100 * bar:.0f} %{', met' if ratio >= bar else ', NOT met'})"
    print(f"{t} find / in-process find, batch {b}, {c} client(s) (medians): {100 * ratio:.1f} %{extra}")
for b in sorted(inproc):
    for c in (1, 4):
        shm, sock = figs.get(("shm", "find", b, c)), figs.get(("socket", "find", b, c))
        if shm and sock:
            print(f"shm find / socket find, batch {b}, {c} client(s) (medians): {med(x[0] for x in shm) / med(x[0] for x in sock):.2f}x")
PY
