#!/bin/bash
# Replays every trace of traces.py through hkv-sim at the capacities of
# reference.py (1-50 % of distinct keys, whole buckets) for lru, lfu and
# adaptive (or $POLICIES); prints CSV rows trace,percent,capacity,policy,hit_percent.
#   shard/bench/run-hkv-sim.sh TRACE_DIR [trace ...] > hkvd.csv
set -euo pipefail
dir=$1; shift
sim=${HKV_SIM:-target/release/hkv-sim}
traces=${*:-drift drift-fast scan-hot bursts loop-mix mixture zipf-0.5 zipf-0.75 zipf-1.0 zipf-1.25}
echo "trace,percent,capacity,policy,hit_percent"
for t in $traces; do
  caps=$(python3 - "$dir/$t.bin" <<'PY'
import sys, numpy as np
d = len(np.unique(np.fromfile(sys.argv[1], dtype="<u8")))
print(",".join(str(max(128, -(-int(d * p / 100) // 128) * 128)) for p in [1, 2, 5, 10, 25, 50]))
PY
)
  "$sim" --trace "$dir/$t.bin" --policy "${POLICIES:-lru,lfu,adaptive}" --capacities "$caps" --batch 64 --json | tail -1 |
    python3 -c "
import json, sys
runs = json.load(sys.stdin)['runs']
caps = sorted({r['capacity'] for r in runs})
pct = dict(zip(caps, [1, 2, 5, 10, 25, 50]))
for r in runs:
    print(f\"$t,{pct[r['capacity']]},{r['capacity']},hkvd-{r['policy']},{100 * r['hit_rate']:.2f}\")
"
done
