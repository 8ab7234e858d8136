"""find_or_insert and find of Zipf batches with repeated keys through CUDA
IPC, against a running hkvd on the CUDA backend (issue 35, "every in-place
write at speed"): a dual lru table of CAPACITY slots is filled, then each
round times ROUNDS requests of BATCH keys drawn Zipf(ALPHA) over KEYS ids,
find_or_insert then find of the same batch, one request in flight.

    python3 daemon/bench/ipc_find_or_insert.py SOCKET [--capacity 1048576]
        [--batch 1048576] [--keys 16777216] [--alpha 0.9] [--dim 32] [--rounds 5]

Prints the median ms per request and M keys/s of each op. Needs torch with
a GPU the daemon serves (the Python client's CUDA IPC transport).
"""

import argparse
import os
import statistics
import sys
import time
import uuid

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import hkvd  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("--capacity", type=int, default=1 << 20)
    p.add_argument("--batch", type=int, default=1 << 20)
    p.add_argument("--keys", type=int, default=1 << 24)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    c = hkvd.Client(a.socket)
    name = "foi_" + uuid.uuid4().hex[:8]
    c.create_table(name, dim=a.dim, capacity=a.capacity, mode="dual")
    dev = torch.device("cuda", 0)
    try:
        rng = np.random.default_rng(35)
        ranks = np.arange(1, a.keys + 1, dtype=np.float64)
        cdf = np.cumsum(ranks ** -a.alpha)
        cdf /= cdf[-1]
        fill = torch.arange(1, a.capacity + 1, dtype=torch.int64, device=dev)
        c.insert_or_assign_region(name, fill, torch.zeros((a.capacity, a.dim), device=dev))
        values = torch.zeros((a.batch, a.dim), device=dev)
        found = torch.zeros(a.batch, dtype=torch.uint8, device=dev)
        times = {"find_or_insert": [], "find": []}
        for _ in range(a.rounds + 1):
            ids = np.searchsorted(cdf, rng.random(a.batch)) + 1
            keys = torch.from_numpy(ids.astype(np.int64)).to(dev)
            torch.cuda.synchronize()
            t = time.perf_counter()
            c.find_or_insert_region(name, keys, values)
            torch.cuda.synchronize()
            times["find_or_insert"].append(time.perf_counter() - t)
            t = time.perf_counter()
            c.find_region(name, keys, values, found)
            torch.cuda.synchronize()
            times["find"].append(time.perf_counter() - t)
        distinct = len(np.unique(ids))
        print(f"{a.batch} keys a request ({distinct} distinct in the last), Zipf {a.alpha} over {a.keys} ids, "
              f"dual lru table of {a.capacity} slots, dim {a.dim}, median of {a.rounds}")
        print("op              ms/request   M keys/s")
        for op, ts in times.items():
            ms = statistics.median(ts[1:]) * 1e3
            print(f"{op:<15} {ms:>10.2f} {a.batch / ms / 1e3:>10.1f}")
    finally:
        c.drop_table(name)
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
