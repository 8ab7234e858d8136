#!/usr/bin/env python3
"""Reference hit ratios from libCacheSim (`pip install libcachesim numpy`)
for the traces of traces.py: exact LRU, ARC, S3-FIFO, W-TinyLFU, LIRS and
Belady at 1–50 % of each trace's distinct keys.

A size is rounded up to whole 128-slot buckets, so that an hkvd table of
that capacity holds exactly as many entries; the capacities are printed
with the figures and `hkv-sim --capacities` takes them as they are.
Output: one CSV row per (trace, size, policy) on stdout:
trace,percent,capacity,policy,hit_percent

    python3 shard/bench/reference.py TRACE_DIR [--traces drift,...] > ref.csv
"""
import argparse
import os
import sys

import libcachesim as lcs
import numpy as np

PERCENTS = [1, 2, 5, 10, 25, 50]
POLICIES = {
    "exact-lru": lambda c: lcs.LRU(c),
    "arc": lambda c: lcs.ARC(c),
    "s3fifo": lambda c: lcs.S3FIFO(c),
    "w-tinylfu": lambda c: lcs.WTinyLFU(c),
    "lirs": lambda c: lcs.LIRS(c),
    "belady": lambda c: lcs.Belady(c),
}


def capacities(distinct):
    return [max(128, -(-int(distinct * p / 100) // 128) * 128) for p in PERCENTS]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir")
    ap.add_argument("--traces", default="")
    ap.add_argument("--policies", default=",".join(POLICIES))
    a = ap.parse_args()
    names = [t for t in a.traces.split(",") if t] or sorted(
        f[: -len(".oracleGeneral.bin")] for f in os.listdir(a.trace_dir) if f.endswith(".oracleGeneral.bin"))
    print("trace,percent,capacity,policy,hit_percent")
    for name in names:
        keys = np.fromfile(os.path.join(a.trace_dir, name + ".bin"), dtype="<u8")
        distinct = len(np.unique(keys))
        path = os.path.join(a.trace_dir, name + ".oracleGeneral.bin")
        for pct, cap in zip(PERCENTS, capacities(distinct)):
            for pol in a.policies.split(","):
                reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
                cache = POLICIES[pol](cap)
                obj_miss, _ = cache.process_trace(reader)
                print(f"{name},{pct},{cap},{pol},{100 * (1 - obj_miss):.2f}", flush=True)
        print(f"{name}: {distinct} distinct keys", file=sys.stderr)


if __name__ == "__main__":
    main()
