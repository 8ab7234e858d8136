"""A small PyTorch training loop whose embeddings live in hkvd.

    python3 python/examples/train_loop.py --socket PATH [--transport auto|cuda-ipc|shm|socket]
        [--table emb] [--dim 32] [--batch 4096] [--steps 300] [--device cuda:0] [--fresh] [--json]

Synthetic click data: 26 categorical fields with Zipf-distributed ids (one
id per field and example; key = field << 40 | id) and 13 dense features;
the click label is drawn from a hidden rule (a fixed per-key effect summed
over the fields, plus a linear term of the dense features), so the loss
goes down as the embeddings learn the effects. The model: each field's row
from hkvd (an embedding bag of one id per field) concatenated with the dense
features, then an MLP. Each step looks the rows up through
``hkvd.torch.EmbeddingCache`` (find_or_insert: unknown ids start at zero),
trains the MLP (Adam), and writes the rows' gradients back with
accum_or_assign (SGD on the rows, in the daemon).

Prints steps/s, the mean step time, the lookup share of the step (lookup +
write-back time over step time, each phase timed between
``torch.cuda.synchronize()`` calls) and the loss over the first and last
steps; ``--json`` prints one JSON line with the same figures. The table is
created (``--capacity`` slots) when missing; ``--fresh`` clears it first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hkvd  # noqa: E402
from hkvd.torch import EmbeddingCache  # noqa: E402

FIELDS = 26
DENSE = 13


def hidden_effect(keys: np.ndarray) -> np.ndarray:
    """The hidden rule's per-key effect, in [-1, 1): a hash of the key."""
    h = (keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return h.astype(np.float64) / float(1 << 24) * 2.0 - 1.0


def make_batches(count: int, batch: int, vocab: int, zipf: float, seed: int):
    """``count`` batches of (keys int64 (batch, FIELDS), dense float32
    (batch, DENSE), labels float32 (batch,)), on the host."""
    rng = np.random.default_rng(seed)
    w_dense = rng.normal(0, 0.5, DENSE)
    out = []
    for _ in range(count):
        ids = (rng.zipf(zipf, size=(batch, FIELDS)) - 1) % vocab
        # Scramble per field so each field's popular ids differ.
        ids = (ids * 2654435761 + np.arange(FIELDS) * 7919) % vocab
        keys = (np.arange(FIELDS, dtype=np.int64) << 40) | ids.astype(np.int64)
        dense = rng.normal(0, 1, (batch, DENSE)).astype(np.float32)
        logit = 2.0 * hidden_effect(keys).sum(axis=1) / np.sqrt(FIELDS / 3.0) + dense @ w_dense
        labels = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        out.append((keys, dense, labels))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", default=None, help="hkvd socket (default: $HKVD_SOCKET, ...)")
    p.add_argument("--table", default="train_loop_emb")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--capacity", type=int, default=1 << 22, help="slots of the table when it is created")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timings")
    p.add_argument("--transport", default="auto", choices=["auto", "cuda-ipc", "shm", "socket"])
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--vocab", type=int, default=200_000, help="ids per field")
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the ids")
    p.add_argument("--batches", type=int, default=64, help="distinct synthetic batches, cycled")
    p.add_argument("--lr", type=float, default=1e-3, help="MLP learning rate (Adam)")
    p.add_argument("--emb-lr", type=float, default=0.05, help="embedding learning rate (SGD in the daemon)")
    p.add_argument("--fresh", action="store_true", help="clear the table before training")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON line with the figures")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error("--steps must exceed --warmup")

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(a.seed)

    c = hkvd.Client(a.socket)
    names = {t["spec"]["name"]: t["spec"] for t in c.tables()}
    if a.table not in names:
        c.create_table(a.table, dim=a.dim, capacity=a.capacity)
    elif names[a.table]["dim"] != a.dim:
        p.error(f"table {a.table} has dim {names[a.table]['dim']}, not {a.dim}: pick another --table")
    elif a.fresh:
        c.clear(a.table)
    try:
        cache = EmbeddingCache(c, a.table, device=device, max_batch=a.batch * FIELDS, transport=a.transport)
    except (hkvd.CudaIpcUnavailable, hkvd.CudaError, hkvd.HkvdError, ValueError, OSError) as e:
        print(f"train_loop: --transport {a.transport} is unavailable: {e}", file=sys.stderr)
        return 2

    data = [tuple(torch.from_numpy(x).to(device) for x in b)
            for b in make_batches(min(a.batches, a.steps), a.batch, a.vocab, a.zipf, a.seed)]
    mlp = torch.nn.Sequential(
        torch.nn.Linear(FIELDS * a.dim + DENSE, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 1)).to(device)
    opt = torch.optim.Adam(mlp.parameters(), lr=a.lr)
    bce = torch.nn.BCEWithLogitsLoss()

    losses, steps_t, lookup_t, write_t = [], [], [], []
    for step in range(a.steps):
        keys, dense, labels = data[step % len(data)]
        sync()
        t0 = time.perf_counter()
        rows = cache.lookup(keys)  # (batch, FIELDS, dim)
        sync()
        t1 = time.perf_counter()
        rows.requires_grad_(True)
        logits = mlp(torch.cat([rows.reshape(a.batch, -1), dense], dim=1)).squeeze(1)
        loss = bce(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        t2 = time.perf_counter()
        cache.apply_gradients(keys, rows.grad, a.emb_lr)
        sync()
        t3 = time.perf_counter()
        losses.append(float(loss.detach()))
        if step >= a.warmup:
            steps_t.append(t3 - t0)
            lookup_t.append(t1 - t0)
            write_t.append(t3 - t2)

    k = min(20, len(losses) // 2)
    step_s = float(np.mean(steps_t))
    fig = {
        "transport": cache.transport,
        "device": str(device),
        "table": a.table,
        "dim": a.dim,
        "batch": a.batch,
        "fields": FIELDS,
        "steps": a.steps,
        "timed_steps": len(steps_t),
        "steps_per_s": round(len(steps_t) / float(np.sum(steps_t)), 2),
        "mean_step_ms": round(step_s * 1e3, 3),
        "lookup_ms": round(float(np.mean(lookup_t)) * 1e3, 3),
        "write_back_ms": round(float(np.mean(write_t)) * 1e3, 3),
        "lookup_share": round(float((np.sum(lookup_t) + np.sum(write_t)) / np.sum(steps_t)), 4),
        "loss_start": round(float(np.mean(losses[:k])), 4),
        "loss_end": round(float(np.mean(losses[-k:])), 4),
    }
    print(f"train_loop: {fig['transport']} on {fig['device']}, batch {a.batch} x {FIELDS} fields, dim {a.dim}, "
          f"{a.steps} steps ({a.warmup} warm-up left out)", file=sys.stderr)
    print(f"  {fig['steps_per_s']} steps/s, mean step {fig['mean_step_ms']} ms: lookup {fig['lookup_ms']} ms + "
          f"write-back {fig['write_back_ms']} ms = {100 * fig['lookup_share']:.1f} % of the step", file=sys.stderr)
    print(f"  loss {fig['loss_start']} -> {fig['loss_end']} (mean of the first and last {k} steps)", file=sys.stderr)
    if a.json:
        print(json.dumps(fig), flush=True)
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
