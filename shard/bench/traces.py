#!/usr/bin/env python3
"""Key traces for cache-policy studies (issue 36).

Each trace is written twice: `NAME.bin` (u64 little-endian keys, what
`hkv-sim --trace` reads) and `NAME.oracleGeneral.bin` (libCacheSim's binary
format, 24 bytes a request: u32 clock time, u64 object id, u32 size = 1,
i64 next-access position or -1; Belady needs the last field).

Keys are ranks pushed through a fixed bijective mix, so neighbouring ranks
fall into unrelated buckets. Usage:

    python3 shard/bench/traces.py OUT_DIR [--requests N] [--only NAME,...]
"""
import argparse
import os

import numpy as np

MASK = (1 << 63) - 1  # keys stay far from the table's reserved top values


def mix(x):
    """splitmix64 finaliser on uint64 arrays (a bijection), top bit cleared."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x & np.uint64(MASK)


def zipf_ranks(rng, universe, alpha, n):
    """n ranks in [0, universe) with P(r) ∝ (r + 1)^-alpha (exact inverse CDF)."""
    w = np.arange(1, universe + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n)), universe - 1).astype(np.uint64)


def iid_zipf(rng, n, alpha, universe=1_000_000):
    return zipf_ranks(rng, universe, alpha, n)


def drift(rng, n, alpha=0.9, universe=500_000, period=200_000):
    """Zipf whose popularity order is re-drawn every `period` requests."""
    ranks = zipf_ranks(rng, universe, alpha, n)
    out = np.empty(n, dtype=np.uint64)
    for start in range(0, n, period):
        perm = rng.permutation(universe).astype(np.uint64)
        out[start:start + period] = perm[ranks[start:start + period]]
    return out


def scan_hot(rng, n, hot=10_000, scan=100_000, share=0.5):
    """A cyclic scan over `scan` keys interleaved with uniform picks of a
    `hot` set: each request is hot with probability `share`."""
    is_hot = rng.random(n) < share
    out = np.empty(n, dtype=np.uint64)
    out[is_hot] = rng.integers(0, hot, is_hot.sum()).astype(np.uint64)
    m = int((~is_hot).sum())
    out[~is_hot] = (hot + np.arange(m) % scan).astype(np.uint64)
    return out


def bursts(rng, n, universe=1_000_000, alpha=0.8, burst_keys=2_000, burst_len=20_000, share=0.6):
    """New items that are hot for a short while then never return (news,
    sessions): in each window of `burst_len` requests, `share` of them go
    to a fresh set of `burst_keys` keys (Zipf 0.6 inside it), the rest to a
    weak long-term Zipf background."""
    out = zipf_ranks(rng, universe, alpha, n)
    inner_w = np.arange(1, burst_keys + 1, dtype=np.float64) ** -0.6
    inner_cdf = np.cumsum(inner_w) / inner_w.sum()
    for w, start in enumerate(range(0, n, burst_len)):
        end = min(start + burst_len, n)
        pick = np.nonzero(rng.random(end - start) < share)[0] + start
        inner = np.searchsorted(inner_cdf, rng.random(len(pick)))
        out[pick] = (universe + w * burst_keys + inner).astype(np.uint64)
    return out


def loop_mix(rng, n, hot_universe=200_000, alpha=1.0, loop=60_000, share=0.3):
    """Zipf traffic with a repeating loop (a batch job re-reading the same
    range) interleaved: LRU keeps the loop it cannot hold."""
    is_loop = rng.random(n) < share
    out = zipf_ranks(rng, hot_universe, alpha, n)
    m = int(is_loop.sum())
    out[is_loop] = (hot_universe + np.arange(m) % loop).astype(np.uint64)
    return out


def mixture(rng, n):
    """Phases: IID Zipf 1.0, drift, a scan storm, bursts, Zipf again on a
    new permutation; each a fifth of the trace."""
    p = n // 5
    parts = [
        iid_zipf(rng, p, 1.0, universe=300_000),
        drift(rng, p, alpha=0.9, universe=300_000, period=100_000) + np.uint64(1 << 40),
        scan_hot(rng, p, hot=20_000, scan=150_000, share=0.4) + np.uint64(2 << 40),
        bursts(rng, p, universe=300_000) + np.uint64(3 << 40),
        iid_zipf(rng, n - 4 * p, 1.0, universe=300_000),
    ]
    return np.concatenate(parts)


TRACES = {
    "drift": lambda rng, n: drift(rng, n),
    "drift-fast": lambda rng, n: drift(rng, n, alpha=1.0, period=50_000),
    "scan-hot": lambda rng, n: scan_hot(rng, n),
    "bursts": lambda rng, n: bursts(rng, n),
    "loop-mix": lambda rng, n: loop_mix(rng, n),
    "mixture": lambda rng, n: mixture(rng, n),
    "zipf-0.5": lambda rng, n: iid_zipf(rng, n, 0.5),
    "zipf-0.75": lambda rng, n: iid_zipf(rng, n, 0.75),
    "zipf-1.0": lambda rng, n: iid_zipf(rng, n, 1.0),
    "zipf-1.25": lambda rng, n: iid_zipf(rng, n, 1.25),
}


def next_access(keys):
    """Position of each request's next request of the same key, -1 if none."""
    n = len(keys)
    order = np.lexsort((np.arange(n), keys))
    nxt = np.full(n, -1, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def write(out_dir, name, keys):
    keys = mix(keys)
    keys.astype("<u8").tofile(os.path.join(out_dir, name + ".bin"))
    rec = np.zeros(len(keys), dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")]))
    rec["t"] = np.arange(len(keys), dtype=np.uint32)
    rec["id"] = keys
    rec["size"] = 1
    rec["next"] = next_access(keys)
    rec.tofile(os.path.join(out_dir, name + ".oracleGeneral.bin"))
    return len(np.unique(keys))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--requests", type=int, default=2_000_000)
    ap.add_argument("--only", default="")
    ap.add_argument("--seed", type=int, default=36)
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    names = [t for t in a.only.split(",") if t] or list(TRACES)
    for i, name in enumerate(names):
        rng = np.random.default_rng(a.seed * 1000 + i)
        keys = TRACES[name](rng, a.requests)
        distinct = write(a.out_dir, name, keys)
        print(f"{name}: {len(keys)} requests, {distinct} distinct keys")


if __name__ == "__main__":
    main()
