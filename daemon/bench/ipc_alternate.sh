#!/usr/bin/env bash
# On a GPU host: the CUDA IPC find (and insert_or_assign) of two or more
# builds of hkvd, alternated round by round in one run, against the
# table's own find in process; with a build that has `stats.path`, where
# the daemon's time went.
#   daemon/bench/ipc_alternate.sh ROUNDS LABEL=DIR [LABEL=DIR ...]
# DIR holds that build's `hkvd` (and `hkvctl`, used unless $HKVCTL_BIN
# names one for every build); the in-process figure comes from
# $HKV_BENCH_BIN (default: the first DIR's hkv-bench; $INPROC_RUNS timed
# batches, default 5, the median). Each round, for each
# build in turn: a fresh `hkvd serve --backend "${BACKEND:-cuda}" --shards 1`, then for
# each B in 262144 1048576 and P in $PIPELINES (default "1 2": 1 is one
# request strictly in flight)
#   hkvctl bench --capacity 4194304 --batches B --clients 1 --pipeline P \
#     --seconds $SECONDS_PER_FIGURE --warmup 0.5 --transport cuda-ipc --json [--ops $OPS]
# with the daemon's `stats.path` read before and after each (a build
# without it says so): the mean time of each stage over that figure's
# requests (the table's filling included). Prints the medians per (build,
# op, batch, pipeline), each over the in-process find at that batch, and
# the stage means. BACKEND=cpu TRANSPORT=shm runs the same on the CPU backend.
set -euo pipefail
rounds=${1:?usage: ipc_alternate.sh ROUNDS LABEL=DIR [LABEL=DIR ...]}
shift
builds=("$@")
secs=${SECONDS_PER_FIGURE:-1.5}
pipelines=${PIPELINES:-1 2}
first=${builds[0]#*=}
hkv_bench=${HKV_BENCH_BIN:-$first/hkv-bench}
tmp=$(mktemp -d)
export HKV_KERNEL_CACHE=${HKV_KERNEL_CACHE:-$tmp/kernels}
hp=
cleanup() { [ -n "$hp" ] && kill "$hp" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1); $(nproc) cores"
for r in $(seq "$rounds"); do
    for b in 262144 1048576; do
        table=$("$hkv_bench" --backend "${BACKEND:-cuda}" --key-mix hits --capacity 4194304 --dims 32 --batch "$b" --ops find --lambdas 0.5 --no-moka --runs "${INPROC_RUNS:-5}")
        kps=$(echo "$table" | awk '/find/ && !f { for (i = 1; i <= NF; i++) if ($i == "find") c = i; f = 1; next } f && c && $c ~ /^[0-9.]+$/ { print $c * 1e9; exit }')
        echo "round $r: in-process find, batch $b: $kps keys/s"
        echo "$b $kps" >> "$tmp/inproc"
    done
    for spec in "${builds[@]}"; do
        label=${spec%%=*}
        dir=${spec#*=}
        rm -rf "$tmp/run" "$tmp/state"
        "$dir/hkvd" serve --backend "${BACKEND:-cuda}" --shards 1 --socket "$tmp/run/hkvd.sock" --state-dir "$tmp/state" --restore none --log warn &
        hp=$!
        for _ in $(seq 600); do "$dir/hkvctl" --socket "$tmp/run/hkvd.sock" ping >/dev/null 2>&1 && break; sleep 0.1; done
        ctl=${HKVCTL_BIN:-$dir/hkvctl}
        lab=$label
        for p in $pipelines; do
            for b in 262144 1048576; do
                "$ctl" --socket "$tmp/run/hkvd.sock" stats --json > "$tmp/before"
                "$ctl" --socket "$tmp/run/hkvd.sock" bench --capacity 4194304 --batches "$b" --clients 1 \
                    --pipeline "$p" --seconds "$secs" --warmup 0.5 --transport "${TRANSPORT:-cuda-ipc}" --json ${OPS:+--ops $OPS} \
                    | grep '^{' | sed "s/^{/{\"build\": \"$lab\", \"pipeline\": $p, /" | tee -a "$tmp/figs"
                "$ctl" --socket "$tmp/run/hkvd.sock" stats --json > "$tmp/after"
                python3 - "$tmp/before" "$tmp/after" "$lab" "$b" "$p" >> "$tmp/paths" <<'PY'
import json, sys
b, a = (json.load(open(f)).get("path") for f in sys.argv[1:3])
label, batch, pipe = sys.argv[3:6]
if not a:
    print(json.dumps({"build": label, "batch": int(batch), "pipeline": int(pipe), "path": None}))
    sys.exit()
d = {k: a[k] - b.get(k, 0) for k in a}
r, c = max(d["requests"], 1), max(d["shard_calls"], 1)
m = {k: d[k + "_ns"] / r / 1e3 for k in ("spawn", "handle", "write", "total")}
m.update({k: d[k + "_ns"] / c / 1e3 for k in ("mailbox", "shard", "wake")})
print(json.dumps({"build": label, "batch": int(batch), "pipeline": int(pipe), "requests": d["requests"], "us": m}))
PY
            done
        done
        kill "$hp"; wait "$hp" 2>/dev/null || true; hp=
    done
done
python3 - "$tmp" <<'PY'
import json, statistics, sys
tmp = sys.argv[1]
med = statistics.median
inproc = {}
for line in open(f"{tmp}/inproc"):
    b, kps = line.split()
    inproc.setdefault(int(b), []).append(float(kps))
figs = {}
for line in open(f"{tmp}/figs"):
    f = json.loads(line)
    figs.setdefault((f["op"], f["batch"], f["pipeline"], f["build"]), []).append(f["keys_per_s"])
print(f"{'op':<17} {'batch':>8} {'pipe':>4} {'build':<16} {'M keys/s (each round)':>36} {'median':>9} {'/in-proc':>9}")
for b, v in sorted(inproc.items()):
    print(f"{'find in process':<17} {b:>8} {'-':>4} {'-':<16} {', '.join(f'{x/1e6:.0f}' for x in v):>36} {med(v)/1e6:>9.1f}")
for (o, b, p, build), v in sorted(figs.items()):
    ratio = med(v) / med(inproc[b]) if o == "find" and b in inproc else float("nan")
    print(f"{o:<17} {b:>8} {p:>4} {build:<16} {', '.join(f'{x/1e6:.0f}' for x in v):>36} {med(v)/1e6:>9.1f} {ratio:>9.2f}")
paths = {}
for line in open(f"{tmp}/paths"):
    f = json.loads(line)
    if f.get("us"):
        paths.setdefault((f["batch"], f["pipeline"], f["build"]), []).append(f["us"])
if paths:
    stages = ("spawn", "handle", "write", "total", "mailbox", "shard", "wake")
    print()
    print("where the daemon's time went, mean us per request (spawn, handle, write, total) and per shard call")
    print("(mailbox, shard, wake), medians over rounds:")
    print(f"{'batch':>8} {'pipe':>4} {'build':<16} " + " ".join(f"{s:>8}" for s in stages))
    for (b, p, build), v in sorted(paths.items()):
        print(f"{b:>8} {p:>4} {build:<16} " + " ".join(f"{med(x[s] for x in v):>8.1f}" for s in stages))
PY
