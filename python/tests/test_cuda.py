"""GPU checks of the Python client's CUDA IPC transport, against a running
daemon on the CUDA backend named by $HKVD_GPU_SOCKET (python/examples/
run_gpu_checks.sh starts one). Skipped unless torch sees a GPU (cupy for
the cupy test) and $HKVD_GPU_SOCKET is set.

Runs under pytest, or as a script where pytest is missing:
``HKVD_GPU_SOCKET=... python3 python/tests/test_cuda.py``.
"""

import os
import sys
import uuid

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hkvd  # noqa: E402
from hkvd import cuda  # noqa: E402

try:
    import pytest
except ImportError:  # script mode
    pytest = None

SOCKET = os.environ.get("HKVD_GPU_SOCKET")


def _import(name):
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return None


torch = _import("torch")
if torch is not None and not torch.cuda.is_available():
    torch = None
cupy = _import("cupy")
if cupy is not None:
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        cupy = None

WHY = "needs torch with a GPU and HKVD_GPU_SOCKET naming a running CUDA daemon's socket"
if pytest is not None:
    pytestmark = pytest.mark.skipif(torch is None or not SOCKET, reason=WHY)


class _Table:
    """A fresh table on the GPU daemon, dropped afterwards."""

    def __init__(self, dim=8, capacity=1 << 18):
        self.c = hkvd.Client(SOCKET)
        self.name = "gpu_" + uuid.uuid4().hex[:12]
        self.c.create_table(self.name, dim=dim, capacity=capacity)
        self.dim = dim

    def __enter__(self):
        return self.c, self.name

    def __exit__(self, *exc):
        try:
            self.c.drop_table(self.name)
        finally:
            self.c.close()


def rows(keys, dim):
    k = np.asarray(keys, dtype=np.float64)
    return (k[:, None] % 997 + np.arange(dim)[None, :] / 8).astype(np.float32)


def test_device_tensors_give_the_socket_answers():
    dev = torch.device("cuda", 0)
    for events in (True, False):
        with _Table() as (c, t):
            keys = torch.arange(1, 1001, dtype=torch.int64, device=dev)
            values = torch.from_numpy(rows(np.arange(1, 1001), 8)).to(dev)
            s = c.insert_or_assign_region(t, keys, values, wait=events, done=False)
            assert s.inserted == 1000, s
            probe = torch.arange(501, 1501, dtype=torch.int64, device=dev)
            out = torch.full((1000, 8), 7.5, device=dev)
            found = torch.zeros(1000, dtype=torch.uint8, device=dev)
            assert c.find_region(t, probe, out, found, wait=events, done=False) == 500
            want, wfound = c.find(t, np.arange(501, 1501, dtype=np.uint64))
            assert np.array_equal(out.cpu().numpy(), want)
            assert np.array_equal(found.cpu().numpy().astype(bool), wfound)
            # bool found flags and a scratch found array.
            fb = torch.zeros(1000, dtype=torch.bool, device=dev)
            assert c.contains_region(t, probe, fb, wait=events, done=False) == 500
            assert np.array_equal(fb.cpu().numpy(), wfound)
            assert c.contains_region(t, probe, wait=events, done=False) == 500
            # find_or_insert: the stored rows for hits, the given ones inserted for misses.
            fi = torch.full((1000, 8), -1.0, device=dev)
            s = c.find_or_insert_region(t, probe, fi, wait=events, done=False)
            assert (s.updated + s.inserted, s.inserted) == (1000, 500), s
            assert np.array_equal(fi[:500].cpu().numpy(), want[:500]) and bool((fi[500:] == -1).all())
            # accum_or_assign (staged by the daemon) and assign.
            c.accum_or_assign_region(t, keys[:10], torch.ones((10, 8), device=dev), wait=events, done=False)
            got, _ = c.find(t, np.arange(1, 11, dtype=np.uint64))
            assert np.allclose(got, rows(np.arange(1, 11), 8) + 1)
            assert c.assign_region(t, keys[:2], values[:2], wait=events, done=False).updated == 2
            assert c.erase_region(t, probe[-100:], wait=events, done=False) == 100
            assert not c.contains(t, np.arange(1401, 1501, dtype=np.uint64)).any()


def test_tensors_of_one_allocation_share_one_region():
    dev = torch.device("cuda", 0)
    with _Table() as (c, t):
        big = torch.zeros((1 << 20,), dtype=torch.float32, device=dev)
        a, b = big[:1000], big[4096:5096]
        ra, oa = c.register_cuda(a)
        rb, ob = c.register_cuda(b)
        assert ra == rb and ob - oa == 4096 * 4
        # Small tensors of the caching allocator: one region per segment.
        x = torch.zeros(256, dtype=torch.int64, device=dev)
        y = torch.zeros(256, dtype=torch.int64, device=dev)
        rx, _ = c.register_cuda(x)
        ry, _ = c.register_cuda(y)
        same = cuda.pointer_info(x.data_ptr())[1] == cuda.pointer_info(y.data_ptr())[1]
        assert (rx == ry) == same
        n = len(c._cuda_regions)
        assert n == (2 if same else 3)
        # A freed allocation's region is dropped when the next one is registered.
        del big, a, b
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        z = torch.zeros((1 << 21,), dtype=torch.float32, device=dev)
        c.register_cuda(z)
        assert len(c._cuda_regions) == n, c._cuda_regions


def test_events_order_the_request_with_a_side_stream():
    dev = torch.device("cuda", 0)
    with _Table() as (c, t):
        n = 1 << 16
        c.insert_or_assign(t, np.arange(1, n + 1, dtype=np.uint64), rows(np.arange(1, n + 1), 8))
        w, d = c.cuda_event(0), c.cuda_event(0)
        assert w.id and d.id and w.id != d.id
        s = torch.cuda.Stream(dev)
        keys = torch.empty(n, dtype=torch.int64, device=dev)
        out = torch.empty((n, 8), device=dev)
        with torch.cuda.stream(s):
            # Work queued on the side stream that the daemon must wait for.
            m = torch.rand((2048, 2048), device=dev)
            for _ in range(8):
                m = m @ m
                m = m / m.norm()
            keys.copy_(torch.arange(1, n + 1, dtype=torch.int64, device=dev) + (m.sum() * 0).long())
            hits = c.find_region(t, keys, out, stream=s, wait=w, done=d)
            d.wait(s.cuda_stream)
            total = out.sum()
        torch.cuda.synchronize()
        # With a done event the daemon answers once the lookup is queued: no
        # count; the event orders the stream after the rows are written.
        assert hits is None
        assert abs(float(total) - float(rows(np.arange(1, n + 1), 8).sum())) < 1e-3 * float(total)
        d.synchronize()
        # The default: the client's own wait event on torch's current
        # stream, no done event: an answer after the lookup, counted.
        keys2 = torch.arange(1, 101, dtype=torch.int64, device=dev)
        out2 = torch.zeros((100, 8), device=dev)
        assert c.find_region(t, keys2, out2) == 100
        assert np.array_equal(out2.cpu().numpy(), rows(np.arange(1, 101), 8))
        # done=True: the client's own done event, the answer uncounted, the
        # current stream made to wait for the rows.
        out3 = torch.zeros((100, 8), device=dev)
        assert c.find_region(t, keys2, out3, done=True) is None
        assert np.array_equal(out3.cpu().numpy(), rows(np.arange(1, 101), 8))


def test_embedding_cache_over_cuda_ipc_equals_the_socket():
    from hkvd.torch import EmbeddingCache

    dev = torch.device("cuda", 0)
    with _Table(dim=16) as (c, t):
        cache = EmbeddingCache(c, t, device=dev, max_batch=1000)
        assert cache.transport == "cuda-ipc", cache.message
        assert "CUDA IPC (GPU 0)" in cache.message
        ids = torch.randint(0, 5000, (3000,), device=dev)  # ~2300 distinct: three chunks
        first = cache.lookup(ids)
        assert first.shape == (3000, 16) and float(first.abs().sum()) == 0.0
        want_rows = torch.from_numpy(rows(np.arange(5000), 16)).to(dev)
        cache.write_back(torch.arange(5000, device=dev), want_rows)
        got = cache.lookup(ids.view(60, 50))
        assert got.shape == (60, 50, 16)
        assert torch.equal(got.view(3000, 16), want_rows[ids])
        sock = EmbeddingCache(c, t, device=dev, max_batch=1000, transport="socket")
        assert torch.equal(sock.lookup(ids), got.view(3000, 16))
        # Gradients: duplicates summed, -lr times added in the daemon.
        grads = torch.ones((3000, 16), device=dev)
        cache.apply_gradients(ids, grads, lr=0.5)
        counts = torch.bincount(ids, minlength=5000).float()
        expect = want_rows - 0.5 * counts[:, None]
        vals, found = c.find(t, np.arange(5000, dtype=np.uint64))
        assert np.allclose(vals[counts.cpu().numpy() > 0], expect[counts > 0].cpu().numpy())
        shm = EmbeddingCache(c, t, device=dev, max_batch=1000, transport="shm")
        assert torch.allclose(shm.lookup(ids), cache.lookup(ids))


# The table optimizers the prefetch test trains with ($HKVD_GPU_OPTIMIZERS, comma separated, to pick).
OPTIMIZERS_ON_GPU = tuple(os.environ.get("HKVD_GPU_OPTIMIZERS", "adam,sgd,rowwise_adagrad,adagrad").split(","))


def test_prefetched_training_over_cuda_ipc_is_bit_identical():
    """The issue's bar on the GPU: two tables (Adam, then SGD, in the table) trained
    over CUDA IPC on the same 300 batches of device ids, one looking up at
    each forward, the other one batch ahead through Prefetcher; every loss
    and every stored row (values and Adam's state) equal bit for bit. Under
    torch's deterministic algorithms: its own sums on the GPU (the sparse
    gradient's per-id sums with index_add_, the MLP's) otherwise vary in
    their last bits from one run to the next, prefetched or not. Both
    deduplications: the module's (torch.unique, sums with index_add_) and
    the table's (a row per position, the repeats' gradients summed by the
    table in fixed point)."""
    from hkvd.torch import Embedding, Prefetcher

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        # apply_gradients in place on the GPU: the table's step kernel.
        for opt in OPTIMIZERS_ON_GPU:
            for dedupe in ("module", "table"):
                _prefetched_training_bit_identical(Embedding, Prefetcher, opt, dedupe)
    finally:
        torch.use_deterministic_algorithms(was)


def _prefetched_training_bit_identical(Embedding, Prefetcher, opt, dedupe):

    fields, vocab, dim, batch, steps = 4, 2000, 16, 512, 300
    dev = torch.device("cuda", 0)
    c = hkvd.Client(SOCKET)
    g = torch.Generator().manual_seed(35)
    data = []
    for _ in range(steps):
        u = torch.rand((batch, fields), generator=g)
        ids = ((vocab * u ** 3).long() + torch.arange(fields) * vocab).to(dev)
        data.append((ids, (ids[:, 0] % 2).float()))
    runs = {}
    names = {}
    for kind, ahead in (("plain", False), ("ahead", True)):
        name = names[kind] = "gpu_pf_" + uuid.uuid4().hex[:10]
        c.create_table(name, dim=dim, capacity=1 << 16, optimizer=opt)
        emb = Embedding(c, name, lr=0.01, init=lambda i: (i % 13).float()[:, None].expand(-1, dim) / 13,
                        transport="cuda-ipc", device=dev, verbose=False, dedupe=dedupe)
        torch.manual_seed(7)
        mlp = torch.nn.Sequential(torch.nn.Linear(fields * dim, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(dev)
        dense = torch.optim.SGD(mlp.parameters(), lr=0.05)
        bce = torch.nn.BCEWithLogitsLoss()
        losses = []
        for ids, y in (Prefetcher(data, emb) if ahead else data):
            dense.zero_grad()
            loss = bce(mlp(emb(ids).flatten(1)).squeeze(1), y)
            loss.backward()
            dense.step()
            losses.append(loss.detach())
        torch.cuda.synchronize()
        runs[kind] = (torch.stack(losses).cpu(), emb)
    try:
        assert torch.equal(runs["plain"][0], runs["ahead"][0]), f"losses bit for bit ({opt}, dedupe {dedupe})"
        ka, va, _ = c.export(names["plain"])
        kb, vb, _ = c.export(names["ahead"])
        oa, ob = np.argsort(ka), np.argsort(kb)
        assert ka.size > 0 and np.array_equal(ka[oa], kb[ob])
        assert np.array_equal(va[oa].view(np.uint32), vb[ob].view(np.uint32)), "rows (values and state) bit for bit"
        what = f"{opt}, dedupe {dedupe}"
        if dedupe == "module":
            assert runs["ahead"][1].prefetch_hits == steps and runs["ahead"][1].patched_rows > 0, what
        else:  # each lookup sent after the step before it: all but the first
            assert runs["ahead"][1].prefetch_hits == steps - 1, what
    finally:
        for n in names.values():
            c.drop_table(n)
        c.close()


def test_cupy_arrays():
    if cupy is None:
        if pytest is not None:
            pytest.skip("needs cupy with a GPU")
        return
    with _Table() as (c, t):
        keys = cupy.arange(1, 101, dtype=cupy.uint64)
        values = cupy.asarray(rows(np.arange(1, 101), 8))
        assert c.insert_or_assign_region(t, keys, values).inserted == 100
        out = cupy.zeros((100, 8), dtype=cupy.float32)
        found = cupy.zeros(100, dtype=cupy.uint8)
        assert c.find_region(t, keys, out, found) == 100
        cupy.cuda.get_current_stream().synchronize()
        assert np.array_equal(cupy.asnumpy(out), rows(np.arange(1, 101), 8))


def main() -> int:
    if torch is None or not SOCKET:
        print("skipped:", WHY)
        return 0
    failed = 0
    names = [n for n in sorted(globals()) if n.startswith("test_")]
    for n in names:
        try:
            globals()[n]()
            print("PASS", n)
        except Exception as e:  # noqa: BLE001 - report every test
            failed += 1
            print("FAIL", n, type(e).__name__, e)
    print(f"{len(names) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
