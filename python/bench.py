"""Python client find throughput beside the Rust client, on one daemon.

    python3 python/bench.py [--socket PATH] [--batches 65536,262144,1048576] [--seconds 2]

Without --socket it starts target/release/hkvd (CPU backend) on a temporary
socket. For each batch size it runs `hkvctl bench` (the Rust client: find on
a dim-32 table of 1 Mi slots, half full, one connection, PIPELINE requests in
flight) and then the same workload from Python, and prints keys/s of both.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hkvd  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def python_find(c, table, resident, batch, seconds, pipeline):
    rng = np.random.default_rng(7)
    reqs = [rng.integers(1, resident + 1, batch, dtype=np.uint64) for _ in range(pipeline + 1)]
    inflight = [c.send_find(table, reqs[i % len(reqs)]) for i in range(pipeline)]
    sent, done = pipeline, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        values, found, _ = c.result(inflight.pop(0))
        done += len(found)
        inflight.append(c.send_find(table, reqs[sent % len(reqs)]))
        sent += 1
    for i in inflight:
        done += len(c.result(i)[1])
    return done / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket")
    ap.add_argument("--batches", default="65536,262144,1048576")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--pipeline", type=int, default=2)
    a = ap.parse_args()
    proc = None
    sock = a.socket
    if sock is None:
        tmp = tempfile.mkdtemp()
        sock = os.path.join(tmp, "hkvd.sock")
        proc = subprocess.Popen([os.path.join(ROOT, "target/release/hkvd"), "serve", "--backend", "cpu",
                                 "--socket", sock, "--state-dir", os.path.join(tmp, "state"), "--log", "warn"])
        for _ in range(400):
            try:
                hkvd.Client(sock).ping()
                break
            except OSError:
                time.sleep(0.05)
    hkvctl = os.path.join(ROOT, "target/release/hkvctl")
    try:
        c = hkvd.Client(sock)
        dim, cap = 32, 1 << 20
        resident = cap // 2
        c.create_table("pybench", dim=dim, capacity=cap)
        for lo in range(1, resident + 1, 1 << 18):
            k = np.arange(lo, min(lo + (1 << 18), resident + 1), dtype=np.uint64)
            c.insert_or_assign("pybench", k, np.full((len(k), dim), 0.5, np.float32))
        print(f"find, dim {dim}, {resident} keys resident, one connection, pipeline {a.pipeline}, {a.seconds} s per figure")
        print(f"{'batch':>8} {'rust keys/s':>14} {'python keys/s':>14} {'python/rust':>12}")
        for batch in [int(b) for b in a.batches.split(",")]:
            out = subprocess.run([hkvctl, "--socket", sock, "bench", "--json", "--batches", str(batch), "--clients", "1",
                                  "--pipeline", str(a.pipeline), "--seconds", str(a.seconds)],
                                 check=True, capture_output=True, text=True).stdout
            figures = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            rust = next(f["keys_per_s"] for f in figures if f["transport"] == "socket" and f["op"] == "find")
            py = python_find(c, "pybench", resident, batch, a.seconds, a.pipeline)
            print(f"{batch:>8} {rust:>14.0f} {py:>14.0f} {100 * py / rust:>11.0f}%")
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
