"""Sampler drops at GPU rates: find_or_insert, then find, over CUDA IPC as
fast as one client sends them (1 Mi keys a request, Zipf 1.1 over 16 Mi
keys, dim 32, a dual table of 4 Mi slots), each for 4 s; after each, the
table's mrc stats (accesses, sampled, dropped, dropped_lookups: accesses
plus dropped_lookups are every lookup served), its measured hit rate and
the curve at 1x. Needs a GPU, PyTorch, and a CUDA daemon of one shard:

    hkvd serve --backend cuda --shards 1 --socket S --restore none &
    PYTHONPATH=python python3 daemon/bench/mrc_gpu_rate.py S
"""
import json
import sys
import time

import numpy as np
import torch

import hkvd

c = hkvd.Client(sys.argv[1])
dim, n = 32, 1 << 20
c.create_table("r", dim, 1 << 22, mode="dual")
dev = torch.device("cuda:0")
rng = np.random.default_rng(1)
z = rng.zipf(1.1, size=(16, n)) % (1 << 24) + 1
batches = [torch.tensor(b.astype(np.int64), device=dev) for b in z]
vals = torch.zeros((n, dim), dtype=torch.float32, device=dev)
found = torch.zeros(n, dtype=torch.uint8, device=dev)


def run(what, f, secs):
    t, k = time.time(), 0
    while time.time() - t < secs:
        f(batches[k % len(batches)])
        k += 1
    torch.cuda.synchronize()
    el = time.time() - t
    time.sleep(0.6)  # two drains
    m = [x for x in c.stats()["tables"] if x["spec"]["name"] == "r"][0].get("mrc") or {}
    print(json.dumps({"phase": what, "batches": k, "keys_per_s": round(k * n / el), "accesses": m.get("accesses"),
                      "sampled": m.get("sampled_accesses"), "dropped": m.get("dropped"),
                      "dropped_lookups": m.get("dropped_lookups"),
                      "measured_hit_rate": m.get("measured_hit_rate"),
                      "curve_at_1x": [p for p in m.get("points", []) if abs(p["factor"] - 1) < 1e-9]}), flush=True)


run("find_or_insert", lambda b: c.find_or_insert_region("r", b, vals), 4)
run("find", lambda b: c.find_region("r", b, vals, found), 4)
