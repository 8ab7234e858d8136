#!/usr/bin/env python3
"""Markdown table of hit % per trace and size: hkvd's policies (CSV of
run-hkv-sim.sh) beside libCacheSim's references (CSV of reference.py),
with the best of exact LRU, ARC, S3-FIFO, W-TinyLFU and LIRS and
adaptive's distance to it (and to hkvd LRU).

    python3 shard/bench/table.py ref.csv hkvd.csv [more.csv ...]
"""
import csv
import sys
from collections import defaultdict

REFS = ["exact-lru", "arc", "s3fifo", "w-tinylfu", "lirs"]


def main():
    hit = defaultdict(dict)
    cap = {}
    for path in sys.argv[1:]:
        with open(path) as f:
            for r in csv.DictReader(f):
                key = (r["trace"], int(r["percent"]))
                hit[key][r["policy"]] = float(r["hit_percent"])
                cap[key] = int(r["capacity"])
    ours = [p for p in ["hkvd-lru", "hkvd-lfu", "hkvd-adaptive"] if any(p in v for v in hit.values())]
    cols = ours + REFS + ["belady"]
    print("| trace | size | slots | " + " | ".join(cols) + " | best ref | adaptive − best | adaptive − hkvd lru |")
    print("|---|---:|---:|" + "---:|" * (len(cols) + 3))
    for key in sorted(hit, key=lambda k: (k[0], k[1])):
        v = hit[key]
        if "hkvd-adaptive" not in v:
            continue
        refs = [v[p] for p in REFS if p in v]
        best = max(refs) if refs else None
        name = max(REFS, key=lambda p: v.get(p, -1)) if refs else ""
        cells = [f"{v[c]:.2f}" if c in v else "–" for c in cols]
        d_best = f"{v['hkvd-adaptive'] - best:+.2f}" if best is not None else "–"
        d_lru = f"{v['hkvd-adaptive'] - v['hkvd-lru']:+.2f}" if "hkvd-lru" in v else "–"
        print(f"| {key[0]} | {key[1]} % | {cap[key]} | " + " | ".join(cells) + f" | {best:.2f} ({name}) | {d_best} | {d_lru} |"
              if best is not None else f"| {key[0]} | {key[1]} % | {cap[key]} | " + " | ".join(cells) + " | – | – | " + d_lru + " |")


if __name__ == "__main__":
    main()
