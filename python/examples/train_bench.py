"""Steps/s of one DLRM-style model with native torch embeddings and with
hkvd's (optimizer in the table), alternated in one process.

    python3 python/examples/train_bench.py --socket PATH [--device cpu|cuda]
        [--variants native,cuda-ipc,shm,socket] [--optimizer sgd|adagrad|rowwise_adagrad|adam]
        [--fields 26] [--batch 512] [--dim 16] [--vocab 20000] [--zipf 1.05] [--pooling 1]
        [--steps 60] [--warmup 10] [--rounds 3] [--no-prefetch] [--profile] [--json]

Synthetic click data: ``--fields`` categorical fields, ``--pooling`` ids per
field and example (1: ``Embedding``; more: ``EmbeddingBag`` with sum
pooling), Zipf(``--zipf``) ids over ``--vocab`` ids per field (the key is
``field * vocab + id``), labels from a hidden per-key effect. The model:
the fields' rows concatenated, then an MLP (SGD), BCE loss.

Variants, each trained from the same initial rows and MLP on the same
batches, one after the other in each round (``--rounds``):

- ``native``: ``torch.nn.Embedding(fields * vocab, dim, sparse=True)`` (or
  ``EmbeddingBag``) on ``--device`` with the matching torch optimizer
  (``SGD``, ``Adagrad``, ``SparseAdam``; row-wise Adagrad has none in
  torch: ``Adagrad`` stands in and the rows are not compared; nor are they
  for Adam: ``SparseAdam`` adds eps before the bias correction, hkvd's
  Adam after it, as ``torch.optim.Adam``, so their rows part where the
  gradients are small; the rows column shows ``-`` for both).
- ``cuda-ipc``, ``shm``, ``socket``: ``hkvd.torch.Embedding`` /
  ``EmbeddingBag`` over a fresh table created with ``--optimizer``, over
  that transport, each batch's lookup prefetched one step ahead
  (``hkvd.torch.Prefetcher``; ``--no-prefetch``: looked up at the forward).
  A transport that is not available (cuda-ipc without a CUDA device the
  daemon serves) is skipped, saying why. The modules deduplicate as by
  default (``dedupe="table"``: every position's id goes to the table,
  which answers a row per position and sums a repeated id's gradients
  itself); the suffix ``:module`` (say ``cuda-ipc:module``) makes them
  ``dedupe="module"`` (``torch.unique`` and ``index_add_`` in the
  training process).

Prints per variant the steps/s (median over rounds of steps / seconds of
the timed steps, after ``--warmup``; a step runs from the end of the
previous one, so the loader's and Prefetcher's work is in it), the mean
time per phase (lookup: embedding forward, or the hkvd module's sending
and receiving of lookups, the prefetch sent between steps included;
apply: the sparse optimizer step, or the module's apply_gradients; compute:
the rest of the step), the loss curve of the first round (the mean loss of
each tenth of the steps), and the largest difference between the rows it
trained and native's (the ids the batches touched), then ``agree`` when it
is within ``--tolerance``. ``--json`` prints one JSON document instead.
Times are host wall-clock with the device synchronized at the end of each
step.

``--profile`` also prints, per hkvd variant and per timed step, where the
training thread waited: the milliseconds spent inside ``torch.unique``,
the region requests' sending (``region.send``/``region.call`` up to the
send) and answer waits (``region.finish``, the answer part of
``region.call``), the stream waits on done events, and the patching of
prefetched rows; nested in those: ``region.frame`` (checking the arrays and
recording the wait event), ``client.call`` (a request's socket round trip),
``apply.chunk`` (one apply_gradients request sent, copies included),
``apply.settle`` (reading its answer, which the step did not wait for,
at the next request) and ``lookup.recv`` (a prefetched lookup's answer
and copy); and the daemon's own means over the variant's requests
(``stats.path``: spawn, handle, write and its queued part, CUDA event
waits, shard calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hkvd  # noqa: E402
import hkvd.torch as ht  # noqa: E402

TRANSPORTS = ("cuda-ipc", "shm", "socket")


class Profile:
    """Wall time (and calls) the training thread spent in a few library
    functions, by name; wraps them while enabled."""

    def __init__(self):
        self.t, self.n = {}, {}
        self._undo = []

    def wrap(self, owner, attr, name):
        f = getattr(owner, attr)

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
                self.n[name] = self.n.get(name, 0) + 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, f))

    def enable(self):
        from hkvd import cuda as hcuda
        from hkvd import region as hregion

        self.wrap(torch, "unique", "torch.unique")
        self.wrap(hregion, "send", "region.send")
        self.wrap(hregion, "finish", "region.finish")
        self.wrap(hregion, "call", "region.call")
        self.wrap(hcuda.CudaEvent, "wait", "event.wait")
        self.wrap(hcuda.CudaEvent, "record", "event.record")
        self.wrap(ht, "_patch", "patch")
        self.wrap(hregion, "_frame", "region.frame")
        self.wrap(hkvd.Client, "_call", "client.call")
        self.wrap(ht.EmbeddingCache, "_step_chunk", "apply.chunk")
        self.wrap(ht.EmbeddingCache, "_recv", "lookup.recv")
        if hasattr(ht.EmbeddingCache, "settle"):
            self.wrap(ht.EmbeddingCache, "settle", "apply.settle")

    def disable(self):
        while self._undo:
            owner, attr, f = self._undo.pop()
            setattr(owner, attr, f)

    def snapshot(self):
        return dict(self.t), dict(self.n)


def path_means(before, after):
    """The daemon's stats.path means (µs) over the requests between two stats documents."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    r, c, w = max(1, d.get("requests", 0)), max(1, d.get("shard_calls", 0)), max(1, d.get("event_waits", 0))
    return {
        "requests": d.get("requests", 0),
        "spawn_us": d.get("spawn_ns", 0) / r / 1e3,
        "handle_us": d.get("handle_ns", 0) / r / 1e3,
        "write_us": d.get("write_ns", 0) / r / 1e3,
        "queue_us": d.get("queue_ns", 0) / r / 1e3,
        "queued": d.get("queued", 0),
        "event_waits": d.get("event_waits", 0),
        "event_wait_us": d.get("event_wait_ns", 0) / w / 1e3,
        "shard_calls": d.get("shard_calls", 0),
        "mailbox_us": d.get("mailbox_ns", 0) / c / 1e3,
        "shard_us": d.get("shard_ns", 0) / c / 1e3,
        "wake_us": d.get("wake_ns", 0) / c / 1e3,
    }


def make_batches(count, batch, fields, vocab, pooling, zipf, seed):
    """``count`` batches of (ids int64 (batch, fields, pooling), labels float32 (batch,))."""
    rng = np.random.default_rng(seed)
    effect_seed = np.uint64(0x9E3779B97F4A7C15)
    out = []
    for _ in range(count):
        ids = (rng.zipf(zipf, size=(batch, fields, pooling)) - 1) % vocab
        ids = (ids * 2654435761 + np.arange(fields)[None, :, None] * 7919) % vocab  # other hot ids per field
        keys = ids + (np.arange(fields) * vocab)[None, :, None]
        h = (keys.astype(np.uint64) * effect_seed) >> np.uint64(40)
        effect = (h.astype(np.float64) / float(1 << 24) * 2.0 - 1.0).mean(axis=2).sum(axis=1)
        logit = 2.0 * effect / np.sqrt(fields / 3.0)
        labels = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        out.append((torch.from_numpy(keys.astype(np.int64)), torch.from_numpy(labels)))
    return out


class Model(torch.nn.Module):
    def __init__(self, emb, fields, dim, pooling, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.fields, self.pooling = emb, fields, pooling
        self.mlp = torch.nn.Sequential(torch.nn.Linear(fields * dim, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def embed(self, ids):
        b = ids.shape[0]
        if self.pooling == 1:
            return self.emb(ids.reshape(b, self.fields)).reshape(b, -1)
        return self.emb(ids.reshape(b * self.fields, self.pooling)).reshape(b, -1)

    def forward(self, rows):
        return self.mlp(rows).squeeze(1)


def native_optimizer(name, params, a):
    if name == "sgd":
        return torch.optim.SGD(params, lr=a.emb_lr)
    if name in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(params, lr=a.emb_lr, eps=a.eps)
    return torch.optim.SparseAdam(params, lr=a.emb_lr, eps=a.eps)


def run(variant, a, c, data, w0, device, round_no, prof=None):
    """One variant's training run: per-step times and phases, losses, and
    the module; with ``prof``, the profile of the timed steps (library
    waits and the daemon's path means)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pooled = a.pooling > 1
    if variant == "native":
        cls = torch.nn.EmbeddingBag if pooled else torch.nn.Embedding
        kw = {"mode": "sum"} if pooled else {}
        emb = cls(a.fields * a.vocab, a.dim, sparse=True, **kw).to(device)
        with torch.no_grad():
            emb.weight.copy_(w0)
        sparse = native_optimizer(a.optimizer, emb.parameters(), a)
        table = None
    else:
        table = f"bench_{variant.replace('-', '_').replace(':', '_')}_{round_no}"
        if table in {t["spec"]["name"] for t in c.tables()}:
            c.drop_table(table)
        c.create_table(table, dim=a.dim, capacity=a.capacity, optimizer=a.optimizer)
        cls = ht.EmbeddingBag if pooled else ht.Embedding
        kw = {"mode": "sum"} if pooled else {}
        try:
            emb = cls(c, table, lr=a.emb_lr, eps=a.eps, init=lambda ids: w0[ids], device=device,
                      transport=variant.removesuffix(":module"), max_batch=a.batch * a.fields * a.pooling,
                      verbose=False, dedupe="module" if variant.endswith(":module") else "table", **kw)
        except BaseException:
            c.drop_table(table)  # the transport is not available here: no table left behind
            raise
        sparse = None
    model = Model(emb, a.fields, a.dim, a.pooling, a.seed).to(device)
    dense = torch.optim.SGD(model.mlp.parameters(), lr=a.lr)
    bce = torch.nn.BCEWithLogitsLoss()
    batches = [(ids.to(device), y.to(device)) for ids, y in data]

    def flat_ids(batch):
        ids = batch[0]
        return ids.reshape(ids.shape[0], a.fields) if not pooled else ids.reshape(-1, a.pooling)

    it = batches if (variant == "native" or not a.prefetch) else ht.Prefetcher(batches, [(emb, flat_ids)])
    steps, phases, losses = [], [], []
    profiled = None
    sync()
    end = time.perf_counter()
    for step, (ids, y) in enumerate(it):
        if prof is not None and table and step == a.warmup:
            prof.enable()
            path0 = c.stats().get("path", {})
        # A step runs from the end of the previous one: the iterator's
        # work (Prefetcher sending the next lookup) is part of it.
        t0 = time.perf_counter()
        before = dict(emb.timings) if table else None
        rows = model.embed(ids)
        if variant == "native":
            sync()
        t1 = time.perf_counter()
        loss = bce(model(rows), y)
        dense.zero_grad()
        if sparse is not None:
            sparse.zero_grad()
        loss.backward()
        dense.step()
        if variant == "native":
            sync()
            t2 = time.perf_counter()
            sparse.step()
        sync()
        t3 = time.perf_counter()
        losses.append(float(loss.detach()))
        start, end = end, t3
        if step < a.warmup:
            continue
        steps.append(t3 - start)
        if prof is not None and table and step == a.steps - 1:
            prof.disable()
            t, n = prof.snapshot()
            profiled = {"waits_ms": {k: t[k] * 1e3 / len(steps) for k in t},
                        "calls": {k: n[k] / len(steps) for k in n},
                        "path": path_means(path0, c.stats().get("path", {}))}
            prof.t, prof.n = {}, {}
        if variant == "native":
            lookup, apply = t1 - t0, t3 - t2
        else:
            # The prefetch sent for the next step (before t0) counts as lookup.
            lookup = emb.timings["lookup"] - before["lookup"] + (t0 - start)
            apply = emb.timings["apply"] - before["apply"]
        phases.append((lookup, t3 - start - lookup - apply, apply))
    return steps, phases, losses, emb, table, profiled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", default=None, help="hkvd socket (default: $HKVD_SOCKET, ...)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--variants", default="native," + ",".join(TRANSPORTS))
    p.add_argument("--optimizer", default="sgd", choices=list(hkvd.OPTIMIZERS))
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--vocab", type=int, default=20_000, help="ids per field")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--pooling", type=int, default=1, help="ids per field and example (>1: EmbeddingBag, sum)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=0, help="distinct batches, cycled (default: --steps)")
    p.add_argument("--capacity", type=int, default=0, help="table slots (default: every key fits)")
    p.add_argument("--lr", type=float, default=0.05, help="MLP learning rate (SGD)")
    p.add_argument("--emb-lr", type=float, default=0.05, help="embedding learning rate")
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--tolerance", type=float, default=1e-3, help="rows within this of native's agree")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="where the training thread and the daemon spent a step")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error("--steps must exceed --warmup")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    a.capacity = a.capacity or 2 * a.fields * a.vocab
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v != "native" and v.removesuffix(":module") not in TRANSPORTS:
            p.error(f"unknown variant {v!r}: use native, {', '.join(TRANSPORTS)} (each also with :module)")

    c = hkvd.Client(a.socket)
    g = torch.Generator().manual_seed(a.seed)
    w0 = (torch.randn((a.fields * a.vocab, a.dim), generator=g) * 0.1).to(device)
    n_batches = a.batches or a.steps
    data = make_batches(n_batches, a.batch, a.fields, a.vocab, a.pooling, a.zipf, a.seed)
    data = [data[i % n_batches] for i in range(a.steps)]
    touched = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in data])).to(device)

    skipped = {}
    results = {v: {"rates": [], "phases": [], "losses": None, "rows_diff": None, "profiles": []} for v in variants}
    prof = Profile() if a.profile else None
    native_rows = None
    for r in range(a.rounds):
        for v in list(variants):
            if v in skipped:
                continue
            try:
                steps, phases, losses, emb, table, profiled = run(v, a, c, data, w0, device, r, prof)
            except (hkvd.CudaIpcUnavailable, hkvd.CudaError, hkvd.HkvdError, ValueError, OSError) as e:
                skipped[v] = str(e)
                print(f"train_bench: {v} skipped: {e}", file=sys.stderr)
                continue
            res = results[v]
            res["rates"].append(len(steps) / sum(steps))
            res["phases"].extend(phases)
            if profiled is not None:
                res["profiles"].append(profiled)
            if r == 0:
                res["losses"] = losses
                if v == "native":
                    native_rows = emb.weight.detach()[touched].clone()
                else:
                    # In finds of at most 1 Mi keys: every touched row may
                    # not fit one answer (limits.max_frame_bytes).
                    keys = touched.cpu().numpy().astype(np.uint64)
                    parts = [c.find(table, keys[s:s + (1 << 20)]) for s in range(0, keys.size, 1 << 20)]
                    vals = np.concatenate([p[0][:, :a.dim] for p in parts]) if parts else np.zeros((0, a.dim), np.float32)
                    found = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, bool)
                    rows = torch.from_numpy(vals)
                    # Rows compare where native runs the same step: not
                    # row-wise Adagrad (Adagrad stands in) nor Adam (torch's
                    # SparseAdam adds eps before the bias correction, Adam
                    # and hkvd after it).
                    if native_rows is not None and a.optimizer in ("sgd", "adagrad") and found.all():
                        res["rows_diff"] = float((rows - native_rows.cpu()).abs().max())
            if table is not None:
                c.drop_table(table)

    out = {"config": {k: getattr(a, k) for k in ("device", "optimizer", "fields", "batch", "dim", "vocab", "zipf",
                                                  "pooling", "steps", "warmup", "rounds", "prefetch")},
           "device": str(device), "skipped": skipped, "variants": {}}
    native_rate = statistics.median(results["native"]["rates"]) if results.get("native", {}).get("rates") else None
    tenth = max(1, a.steps // 10)
    for v in variants:
        res = results[v]
        if not res["rates"]:
            continue
        ph = np.array(res["phases"]) * 1e3
        rate = statistics.median(res["rates"])
        curve = [round(float(np.mean(res["losses"][i:i + tenth])), 4) for i in range(0, a.steps, tenth)]
        out["variants"][v] = {
            "steps_per_s": round(rate, 2),
            "vs_native": round(rate / native_rate, 3) if native_rate else None,
            "rounds": [round(x, 2) for x in res["rates"]],
            "lookup_ms": round(float(ph[:, 0].mean()), 3),
            "compute_ms": round(float(ph[:, 1].mean()), 3),
            "apply_ms": round(float(ph[:, 2].mean()), 3),
            "loss_curve": curve,
            "rows_max_diff": res["rows_diff"],
            "rows_agree": None if res["rows_diff"] is None else res["rows_diff"] <= a.tolerance,
        }
        if res["profiles"]:
            out["variants"][v]["profile"] = res["profiles"][len(res["profiles"]) // 2]
    if a.json:
        print(json.dumps(out))
        return 0
    cfg = out["config"]
    print(f"train_bench on {device}: {a.fields} fields x {a.pooling} ids, batch {a.batch}, dim {a.dim}, "
          f"vocab {a.vocab}/field, Zipf {a.zipf}, optimizer {a.optimizer}, {a.steps} steps "
          f"({a.warmup} warm-up) x {a.rounds} rounds, prefetch {'on' if cfg['prefetch'] else 'off'}")
    print(f"{'variant':<9} {'steps/s':>9} {'vs native':>9} {'lookup ms':>10} {'compute ms':>11} {'apply ms':>9}  rows")
    for v, r in out["variants"].items():
        rows = "-" if r["rows_max_diff"] is None else \
            f"max diff {r['rows_max_diff']:.2e} {'agree' if r['rows_agree'] else 'DIFFER'}"
        vs = "-" if r["vs_native"] is None else f"{r['vs_native']:.3f}"
        print(f"{v:<9} {r['steps_per_s']:>9.1f} {vs:>9} {r['lookup_ms']:>10.2f} {r['compute_ms']:>11.2f} "
              f"{r['apply_ms']:>9.2f}  {rows}")
    for v, r in out["variants"].items():
        print(f"loss {v:<9} " + " ".join(f"{x:.4f}" for x in r["loss_curve"]))
    for v, r in out["variants"].items():
        pr = r.get("profile")
        if not pr:
            continue
        waits = "  ".join(f"{k} {ms:.3f} ({pr['calls'][k]:.1f}x)" for k, ms in sorted(pr["waits_ms"].items()))
        print(f"profile {v} (ms per step, the middle round): {waits}")
        pm = pr["path"]
        print(f"profile {v} daemon, mean us over {pm['requests']} requests: spawn {pm['spawn_us']:.1f} "
              f"handle {pm['handle_us']:.1f} write {pm['write_us']:.1f} (queued {pm['queue_us']:.1f}, "
              f"{pm['queued']} answers); {pm['event_waits']} event waits, mean {pm['event_wait_us']:.1f}; "
              f"{pm['shard_calls']} shard calls: mailbox {pm['mailbox_us']:.1f} shard {pm['shard_us']:.1f} "
              f"wake {pm['wake_us']:.1f}")
    for v, why in skipped.items():
        print(f"skipped {v}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
