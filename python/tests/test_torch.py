"""EmbeddingCache on CPU tensors (skipped without torch): it falls back to
shared memory, then the socket, says which, and every transport gives the
same rows; apply_gradients sums repeated ids; batches are split."""

import os

import numpy as np
import pytest

import hkvd

torch = pytest.importorskip("torch")

from hkvd.torch import EmbeddingCache  # noqa: E402


def test_cpu_tensors_use_shm_and_every_transport_agrees(daemon, capsys):
    c = daemon.client()
    c.create_table("emb", dim=4, capacity=1 << 14)
    cache = EmbeddingCache(c, "emb", device="cpu", max_batch=100)
    assert cache.transport == "shm"
    assert "table emb over shared memory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cuda-ipc needs a CUDA device"):
        EmbeddingCache(c, "emb", device="cpu", transport="cuda-ipc")
    sock = EmbeddingCache(c, "emb", device="cpu", transport="socket", verbose=False)
    assert sock.transport == "socket" and sock.message == "hkvd.torch: table emb over the socket"

    ids = torch.randint(0, 1000, (30, 20))  # 600 ids, ~450 distinct: split in batches of 100
    first = cache.lookup(ids)
    assert first.shape == (30, 20, 4) and float(first.abs().sum()) == 0.0
    assert c.contains("emb", np.unique(ids.numpy()).astype(np.uint64)).all()
    want = torch.arange(4000, dtype=torch.float32).reshape(1000, 4)
    cache.write_back(torch.arange(1000), want)
    got = cache.lookup(ids)
    assert torch.equal(got, want[ids])
    assert torch.equal(sock.lookup(ids), got)
    # Gradients: -lr times the sum over repeated ids.
    grads = torch.ones((30, 20, 4))
    cache.apply_gradients(ids, grads, lr=0.5)
    counts = torch.bincount(ids.reshape(-1), minlength=1000).float()
    assert torch.allclose(sock.lookup(torch.arange(1000)), want - 0.5 * counts[:, None])
    sock.apply_gradients(ids, grads, lr=0.5)
    assert torch.allclose(cache.lookup(torch.arange(1000)), want - counts[:, None])
    # numpy ids (uint64 too) and an init function.
    fresh = EmbeddingCache(c, "emb", init=lambda n, d: np.full((n, d), 2.0, np.float32), device="cpu",
                           verbose=False)
    rows = fresh.lookup(np.array([5000, 5001, 5000], dtype=np.uint64))
    assert rows.shape == (3, 4) and bool((rows == 2.0).all())
    assert fresh.lookup([]).shape == (0, 4)
    c.close()


def test_cuda_ipc_transport_simulated_over_a_memfd(daemon, monkeypatch):
    # EmbeddingCache's cuda-ipc path (one buffer for keys, values and found,
    # prefixes named by Ref.head, rows copied out) with libcuda replaced by
    # stand-ins and the "device buffer" being an shm array that
    # register_cuda registers as a memfd, so a CPU daemon serves it.
    import struct

    import hkvd
    from hkvd import cuda, region
    from hkvd.torch import EmbeddingCache as EC

    holder = {}

    def device_buffer(self, nbytes):
        holder["alloc"] = hkvd.shm_array((nbytes,), np.uint8)
        return torch.from_numpy(holder["alloc"])

    def span():
        a = holder["alloc"]
        return a.__array_interface__["data"][0], a.nbytes

    real_describe = cuda.describe

    def describe(x):
        if isinstance(x, torch.Tensor) and "alloc" in holder:
            base, size = span()
            if base <= x.data_ptr() < base + size:
                return cuda.DeviceArray(x.data_ptr(), x.numel() * x.element_size(), tuple(x.shape),
                                        np.dtype(str(x.dtype).replace("torch.", "")), x.is_contiguous(), 0,
                                        "torch", x)
        return real_describe(x)

    monkeypatch.setattr(EC, "_device_buffer", device_buffer)
    monkeypatch.setattr(cuda, "describe", describe)
    monkeypatch.setattr(cuda, "pointer_info", lambda ptr: (cuda.CU_MEMORYTYPE_DEVICE, 9, 0))
    monkeypatch.setattr(cuda, "allocation", lambda ptr, ordinal: (*span(), bytes(64)))
    monkeypatch.setattr(cuda, "device_uuid", lambda ordinal: bytes(16))
    monkeypatch.setattr(cuda, "synchronize", lambda stream, ordinal: None)
    monkeypatch.setattr(cuda, "stream_handle", lambda stream, lib, ordinal: 0)
    real_raw = region.raw_call

    def raw_call(client, op, body, flags=0):
        if op == cuda.OP_REGISTER_CUDA:
            m, _ = hkvd.shm._memfd_of(holder["alloc"])
            return struct.pack("<IQ", hkvd.shm.register_memfd(client, m.fd, m.size), m.size)
        return real_raw(client, op, body, flags)

    monkeypatch.setattr(region, "raw_call", raw_call)

    c = daemon.client()
    c.create_table("emb", dim=4, capacity=1 << 14)
    cache = EC(c, "emb", device="cpu", max_batch=100, transport="cuda-ipc", events=False)
    assert cache.transport == "cuda-ipc" and len(c._cuda_regions) == 1
    sock = EC(c, "emb", device="cpu", transport="socket", verbose=False)
    ids = torch.randint(0, 1000, (30, 20))
    assert float(cache.lookup(ids).abs().sum()) == 0.0
    want = torch.arange(4000, dtype=torch.float32).reshape(1000, 4)
    cache.write_back(torch.arange(1000), want)
    assert torch.equal(cache.lookup(ids), want[ids])
    assert torch.equal(sock.lookup(ids), want[ids])
    cache.apply_gradients(ids, torch.ones((30, 20, 4)), lr=0.5)
    counts = torch.bincount(ids.reshape(-1), minlength=1000).float()
    assert torch.allclose(sock.lookup(torch.arange(1000)), want - 0.5 * counts[:, None])
    assert len(c._cuda_regions) == 1
    c.close()


# ---- optimizers in the table, hkvd.torch.Embedding / EmbeddingBag -------

def _rows(c, table, ids, dim):
    """The stored values of ``ids`` (the state columns left out)."""
    v, found = c.find(table, np.asarray(ids, dtype=np.uint64))
    assert found.all()
    return torch.from_numpy(v[:, :dim].copy())


@pytest.mark.parametrize("transport", ["shm", "socket"])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam", "rowwise_adagrad"])
def test_each_optimizer_matches_torch(daemon, opt, transport):
    """apply_gradients through Embedding's backward against torch.optim on
    one dense parameter (every row gets a gradient at every step, so
    torch's dense Adam and Adagrad are the reference), and row-wise Adagrad
    against its formula. Tolerance: 1e-6 absolute (sgd), 2e-5 (others:
    the same float32 formulas, evaluated in another order)."""
    from hkvd.torch import Embedding

    c = daemon.client()
    n, dim = 50, 4
    c.create_table("t", dim=dim, capacity=1 << 12, optimizer=opt)
    assert c.dim("t") == dim + {"sgd": 0, "adagrad": dim, "adam": 2 * dim, "rowwise_adagrad": 1}[opt]
    assert c.value_dim("t") == dim and c.optimizer("t") == opt
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn((n, dim), generator=g)
    hp = dict(lr=0.05, weight_decay=0.01)
    emb = Embedding(c, "t", init=lambda ids: w0[ids], eps=1e-6, betas=(0.8, 0.95), transport=transport,
                    verbose=False, **hp)
    assert emb.cache.transport == transport
    ref = torch.nn.Parameter(w0.clone())
    if opt == "sgd":
        o = torch.optim.SGD([ref], **hp)
    elif opt == "adagrad":
        o = torch.optim.Adagrad([ref], eps=1e-6, **hp)
    elif opt == "adam":
        o = torch.optim.Adam([ref], eps=1e-6, betas=(0.8, 0.95), **hp)
    acc = torch.zeros(n)
    for step in range(6):
        ids = torch.cat([torch.randperm(n, generator=g), torch.randint(0, n, (20,), generator=g)])
        target = torch.randn((ids.numel(), dim), generator=g)
        (emb(ids) * target).sum().backward()
        if opt == "rowwise_adagrad":
            with torch.no_grad():
                grad = torch.zeros((n, dim)).index_add_(0, ids, target) + 0.01 * ref
                acc += (grad * grad).mean(dim=1)
                ref -= 0.05 * grad / (acc.sqrt() + 1e-6)[:, None]
        else:
            o.zero_grad()
            (ref[ids] * target).sum().backward()
            o.step()
    got = _rows(c, "t", np.arange(n), dim)
    tol = 1e-6 if opt == "sgd" else 2e-5
    assert torch.allclose(got, ref.detach(), atol=tol, rtol=0), (got - ref.detach()).abs().max()
    assert emb.step == 6 and emb.missing == 0
    # The stored state: adagrad's sum of squares is torch's state_sum.
    if opt == "adagrad":
        v, _ = c.find("t", np.arange(n, dtype=np.uint64))
        assert torch.allclose(torch.from_numpy(v[:, dim:].copy()), o.state[ref]["sum"], rtol=1e-5)
    c.close()


def test_apply_gradients_on_the_client_and_its_refusals(daemon):
    import hkvd

    c = daemon.client()
    c.create_table("p", dim=2, capacity=1024)
    c.create_table("s", dim=2, capacity=1024, optimizer="sgd")
    c.insert_or_assign("s", [1, 2], np.array([[1, 1], [2, 2]], np.float32))
    missing, found, values = c.apply_gradients("s", [1, 3, 2], np.ones((3, 2), np.float32), lr=0.5, values=True)
    assert missing == 1 and found.tolist() == [True, False, True]
    assert values.tolist() == [[0.5, 0.5], [0.0, 0.0], [1.5, 1.5]]
    assert c.apply_gradients("s", [1], np.ones((1, 2), np.float32), lr=0.5) == 0
    with pytest.raises(hkvd.BadRequest):
        c.apply_gradients("p", [1], np.ones((1, 2), np.float32), lr=0.5)
    with pytest.raises(hkvd.WrongDim):
        c.apply_gradients("s", [1], np.ones((1, 3), np.float32), lr=0.5)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        c.create_table("x", dim=2, capacity=1024, optimizer="lion")
    # The region form over shm, with found and values written.
    keys, grads = hkvd.shm_array((2,), np.uint64), hkvd.shm_array((2, 2), np.float32)
    found, out = hkvd.shm_array((2,), np.uint8), hkvd.shm_array((2, 2), np.float32)
    keys[:] = [2, 9]
    grads[:] = 1.0
    assert c.apply_gradients_region("s", keys, grads, found, out, lr=1.0) == 1
    assert found.tolist() == [1, 0] and out.tolist() == [[0.5, 0.5], [0.0, 0.0]]
    with pytest.raises(ValueError, match="value dim 2"):
        c.apply_gradients_region("s", keys, hkvd.shm_array((2, 3), np.float32), lr=1.0)
    from hkvd.torch import Embedding

    with pytest.raises(ValueError, match="has no optimizer"):
        Embedding(c, "p", verbose=False)
    c.close()


class _Model(torch.nn.Module):
    """A few sparse fields, an MLP, one logit."""

    def __init__(self, emb, fields, dim, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = emb
        self.mlp = torch.nn.Sequential(torch.nn.Linear(fields * dim, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, ids):
        return self.mlp(self.emb(ids).flatten(1)).squeeze(1)


def _data(steps, batch, fields, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        # Zipf-like ids: most of a batch on a few hot ids per field.
        u = torch.rand((batch, fields), generator=g)
        ids = (vocab * u ** 3).long() + torch.arange(fields) * vocab
        y = (ids[:, 0] % 2).float()  # learnable from the first field's rows
        out.append((ids, y))
    return out


@pytest.mark.parametrize("dedupe", ["module", "table"])
@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_training_matches_native_sparse_embeddings(daemon, opt, dedupe):
    """The same model trained with hkvd.torch.Embedding (optimizer in the
    table, over shm) and with torch.nn.Embedding(sparse=True) and the
    matching torch optimizer reaches the same losses. Tolerance: 1e-5
    (sgd) and 1e-4 (adagrad) on every step's loss, and on the final rows.
    With dedupe "table" the table sums the repeated ids' gradients."""
    from hkvd.torch import Embedding

    # One thread: torch's CPU sums over several threads may differ in their
    # last bits between the two models, which 40 steps then amplify.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train_against_native(daemon, opt, dedupe, Embedding)
    finally:
        torch.set_num_threads(threads)


def _train_against_native(daemon, opt, dedupe, Embedding):
    fields, vocab, dim, lr = 3, 100, 8, 0.1
    c = daemon.client()
    c.create_table("m", dim=dim, capacity=1 << 12, optimizer=opt)
    native = torch.nn.Embedding(fields * vocab, dim, sparse=True)
    w0 = native.weight.detach().clone()
    ours = Embedding(c, "m", lr=lr, eps=1e-10, init=lambda ids: w0[ids], verbose=False, dedupe=dedupe)
    a, b = _Model(native, fields, dim, 7), _Model(ours, fields, dim, 7)
    sparse = torch.optim.SGD(native.parameters(), lr=lr) if opt == "sgd" else \
        torch.optim.Adagrad(native.parameters(), lr=lr, eps=1e-10)
    dense_a = torch.optim.SGD(a.mlp.parameters(), lr=lr)
    dense_b = torch.optim.SGD(b.mlp.parameters(), lr=lr)
    bce = torch.nn.BCEWithLogitsLoss()
    la, lb = [], []
    for ids, y in _data(40, 64, fields, vocab, 3):
        for m, opts, losses in ((a, (sparse, dense_a), la), (b, (dense_b,), lb)):
            for o in opts:
                o.zero_grad()
            loss = bce(m(ids), y)
            loss.backward()
            for o in opts:
                o.step()
            losses.append(float(loss.detach()))
    tol = 1e-5 if opt == "sgd" else 1e-4
    assert np.allclose(la, lb, atol=tol, rtol=0), max(abs(x - y) for x, y in zip(la, lb))
    assert np.mean(la[-5:]) < np.mean(la[:5]), "the model learned"
    seen = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in _data(40, 64, fields, vocab, 3)]))
    assert torch.allclose(_rows(c, "m", seen.numpy(), dim), native.weight.detach()[seen], atol=tol, rtol=0)
    assert list(b.parameters()) == list(b.mlp.parameters()), "the table's rows are not module parameters"
    c.close()


@pytest.mark.parametrize("dedupe", ["module", "table"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_matches_native(daemon, mode, dedupe):
    """EmbeddingBag over (values, offsets), empty bag included, and over a
    2-D batch, against nn.EmbeddingBag(sparse=True) with SGD: same outputs
    and rows after 5 steps (1e-5)."""
    from hkvd.torch import EmbeddingBag

    c = daemon.client()
    c.create_table("b", dim=4, capacity=1 << 12, optimizer="sgd")
    native = torch.nn.EmbeddingBag(300, 4, mode=mode, sparse=True)
    w0 = native.weight.detach().clone()
    ours = EmbeddingBag(c, "b", mode=mode, lr=0.2, init=lambda ids: w0[ids], verbose=False, dedupe=dedupe)
    o = torch.optim.SGD(native.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        values = torch.randint(0, 300, (40,), generator=g)
        offsets = torch.tensor([0, 3, 3, 10, 25])  # bag 1 is empty
        target = torch.randn((5, 4), generator=g)
        got, want = ours(values, offsets), native(values, offsets)
        assert torch.allclose(got, want, atol=1e-5), step
        assert float(got[1].detach().abs().sum()) == 0.0
        o.zero_grad()
        (want * target).sum().backward()
        o.step()
        (got * target).sum().backward()
        two_d = torch.randint(0, 300, (6, 5), generator=g)
        assert torch.allclose(ours(two_d), native(two_d), atol=1e-5)
    v, found = c.find("b", np.arange(300, dtype=np.uint64))
    found = torch.from_numpy(found)
    assert torch.allclose(torch.from_numpy(v)[found], native.weight.detach()[found], atol=1e-5)
    assert torch.equal(native.weight.detach()[~found], w0[~found]), "ids never seen: untouched in both"
    with pytest.raises(ValueError, match="needs offsets"):
        ours(torch.tensor([1, 2]))
    c.close()


@pytest.mark.parametrize("dedupe", ["module", "table"])
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_prefetched_training_is_bit_identical(daemon, transport, dedupe):
    """Two tables trained on the same batches, one looking up at each
    forward, the other one batch ahead through Prefetcher (the next
    step's lookup sent before this step's backward updates rows that both
    batches share): every loss and every stored row (values and Adam's
    state) equal bit for bit after 25 steps; the prefetch path was taken
    and rows were patched."""
    from hkvd.torch import Embedding, Prefetcher

    fields, vocab, dim = 3, 50, 8
    c = daemon.client()
    runs = {}
    for name, ahead in (("plain", False), ("ahead", True)):
        c.create_table(name, dim=dim, capacity=1 << 14, optimizer="adam")
        emb = Embedding(c, name, lr=0.01, init=lambda ids: (ids % 13).float()[:, None].expand(-1, dim) / 13,
                        transport=transport, verbose=False, dedupe=dedupe)
        model = _Model(emb, fields, dim, 11)
        dense = torch.optim.SGD(model.mlp.parameters(), lr=0.05)
        bce = torch.nn.BCEWithLogitsLoss()
        data = _data(25, 32, fields, vocab, 9)
        losses = []
        for ids, y in (Prefetcher(data, emb) if ahead else data):
            dense.zero_grad()
            loss = bce(model(ids), y)
            loss.backward()
            dense.step()
            losses.append(loss.detach())
        runs[name] = (torch.stack(losses), emb)
    assert torch.equal(runs["plain"][0], runs["ahead"][0])
    ka, va, _ = c.export("plain")
    kb, vb, _ = c.export("ahead")
    oa, ob = np.argsort(ka), np.argsort(kb)
    assert np.array_equal(ka[oa], kb[ob]) and ka.size > 0
    assert np.array_equal(va[oa].view(np.uint32), vb[ob].view(np.uint32)), "rows (values and state) bit for bit"
    ahead = runs["ahead"][1]
    if dedupe == "module":
        assert ahead.prefetch_hits == 25 and runs["plain"][1].prefetch_hits == 0
        assert ahead.patched_rows > 0, "consecutive batches share ids: the patch path ran"
    else:
        # Each lookup is sent after the step before it: all but the first.
        assert ahead.prefetch_hits == 24 and runs["plain"][1].prefetch_hits == 0
    c.close()


@pytest.mark.parametrize("transport", ["shm", "socket", "cuda-ipc"])
def test_a_pending_prefetch_is_patched_after_other_lookups(daemon, monkeypatch, transport):
    """A prefetch left pending past forwards of other ids keeps the
    updated rows of the steps between: a lookup of other ids by the same
    module wrote the cache's buffers that a step's patch still read, and
    the prefetched forward got another id's row (over shm: id 3's 300
    instead of id 1's 99)."""
    from hkvd.torch import Embedding

    if transport == "cuda-ipc":
        _simulate_cuda(monkeypatch)  # the same buffers over a CPU daemon
    c = daemon.client()
    c.create_table("pend", dim=1, capacity=1024, optimizer="sgd")
    emb = Embedding(c, "pend", lr=1.0, transport=transport, verbose=False, events=transport != "cuda-ipc",
                    init=lambda u: u.float()[:, None] * 100)
    assert emb.cache.transport == transport
    emb.prefetch(torch.tensor([1]))
    emb(torch.tensor([1, 2])).sum().backward()  # not the prefetched ids: row 1 100 -> 99
    emb(torch.tensor([3, 4])).sum().backward()  # a lookup of other ids by the same module
    got = emb(torch.tensor([1]))
    assert emb.prefetch_hits == 1
    assert got.tolist() == [[99.0]] and c.find("pend", [1])[0].tolist() == [[99.0]]
    c.close()


def test_hyperparameters_are_checked_when_the_module_is_made(daemon):
    """What the table would refuse at the step (after the backward, the
    step then lost) is refused by the constructor."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("hp", dim=2, capacity=1024, optimizer="adam")
    for kw, match in [({"lr": -1.0}, "must not be negative"), ({"lr": float("nan")}, "lr nan is not a finite"),
                      ({"eps": -1e-8}, "must not be negative"), ({"weight_decay": float("inf")}, "weight_decay inf"),
                      ({"betas": (1.0, 0.999)}, r"betas \(1.0, 0.999\) must lie in \[0, 1\)"),
                      ({"betas": (0.9,)}, r"betas must be two numbers \(beta1, beta2\), not \(0.9,\)")]:
        with pytest.raises(ValueError, match=match):
            Embedding(c, "hp", verbose=False, **kw)
    assert Embedding(c, "hp", lr=0.0, verbose=False).transport == "shm"
    c.close()


def test_a_table_made_again_with_another_dim_is_named(daemon):
    """A module whose table was dropped and created again with another
    dim says so, instead of the daemon's row widths: by another client
    (the daemon refuses that connection's next request on it), or by the
    module's own."""
    from hkvd.torch import Embedding

    c, other = daemon.client(), daemon.client()
    c.create_table("again", dim=3, capacity=1024, optimizer="adam")
    emb = Embedding(c, "again", verbose=False)
    emb(torch.tensor([1, 2])).sum().backward()
    emb.flush()  # the step done before the other connection drops the table
    other.drop_table("again")
    other.create_table("again", dim=5, capacity=1024, optimizer="adam")
    with pytest.raises(hkvd.UnknownTable, match="dropped and created again since this module was made"):
        emb(torch.tensor([1]))
    # And every forward after it (the second one failed on the old width's buffers).
    with pytest.raises(hkvd.UnknownTable, match="dropped and created again since this module was made"):
        emb(torch.tensor([1, 2]))
    # Made again by the module's own client (over shm the request's buffer
    # check answered first, with a shape error that named no table).
    for dedupe in ("table", "module"):
        name = f"again_own_{dedupe}"
        c.create_table(name, dim=4, capacity=1024, optimizer="adam")
        own = Embedding(c, name, verbose=False, dedupe=dedupe)
        own(torch.tensor([1, 2])).sum().backward()
        own.flush()
        c.drop_table(name)
        c.create_table(name, dim=7, capacity=1024, optimizer="adam")
        for _ in range(2):
            with pytest.raises(hkvd.WrongDim, match="now has dim 7 and optimizer adam, not the dim 4"):
                own(torch.tensor([1, 2]))
    c.close()
    other.close()


def test_a_prefetch_for_other_ids_is_dropped(daemon):
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("d", dim=2, capacity=1024, optimizer="sgd")
    # The module's deduplication sends a prefetch at once (the table's
    # after the next step).
    emb = Embedding(c, "d", lr=1.0, verbose=False, dedupe="module")
    emb.prefetch(torch.tensor([1, 2]))
    out = emb(torch.tensor([3, 4]))  # not the prefetched ids: looked up now
    assert out.shape == (2, 2) and emb.prefetch_hits == 0
    ids = torch.tensor([6, 7])
    emb.prefetch(ids)
    ids[0] = 3  # changed in place after the prefetch: not the ids it fetched
    assert emb(ids).shape == (2, 2) and emb.prefetch_hits == 0
    emb.prefetch(torch.tensor([5]))
    out = emb(torch.tensor([5]))  # equal ids in other memory: compared, taken
    assert emb.prefetch_hits == 1
    out.sum().backward()
    assert c.find("d", [5])[0][0].tolist() == [-1.0, -1.0]
    with torch.inference_mode():  # ids without a version counter: kept as a copy
        frozen = torch.tensor([8, 9])
    emb.prefetch(frozen)
    with torch.inference_mode():
        assert emb(frozen).shape == (2, 2) and emb.prefetch_hits == 2
    c.close()


def _simulate_cuda(monkeypatch):
    """libcuda replaced by stand-ins: each "device buffer" EmbeddingCache
    allocates is an shm array that register_cuda registers as a memfd, so
    the cuda-ipc code path runs against a CPU daemon."""
    import struct

    import hkvd
    from hkvd import cuda, region
    from hkvd.torch import EmbeddingCache as EC

    allocs = []

    def device_buffer(self, nbytes):
        allocs.append(hkvd.shm_array((nbytes,), np.uint8))
        return torch.from_numpy(allocs[-1])

    def owner(ptr):
        for i, a in enumerate(allocs):
            base = a.__array_interface__["data"][0]
            if base <= ptr < base + a.nbytes:
                return i, base, a.nbytes
        return None

    real_describe = cuda.describe

    def describe(x):
        if isinstance(x, torch.Tensor) and owner(x.data_ptr()) is not None:
            return cuda.DeviceArray(x.data_ptr(), x.numel() * x.element_size(), tuple(x.shape),
                                    np.dtype(str(x.dtype).replace("torch.", "")), x.is_contiguous(), 0, "torch", x)
        return real_describe(x)

    monkeypatch.setattr(EC, "_device_buffer", device_buffer)
    monkeypatch.setattr(cuda, "describe", describe)
    monkeypatch.setattr(cuda, "pointer_info", lambda ptr: (cuda.CU_MEMORYTYPE_DEVICE, 100 + owner(ptr)[0], 0))
    monkeypatch.setattr(cuda, "allocation", lambda ptr, ordinal: (*owner(ptr)[1:], bytes([owner(ptr)[0]]) + bytes(63)))
    monkeypatch.setattr(cuda, "device_uuid", lambda ordinal: bytes(16))
    monkeypatch.setattr(cuda, "synchronize", lambda stream, ordinal: None)
    monkeypatch.setattr(cuda, "stream_handle", lambda stream, lib, ordinal: 0)
    real_raw = region.raw_call

    def raw_call(client, op, body, flags=0):
        if op == cuda.OP_REGISTER_CUDA:
            m, _ = hkvd.shm._memfd_of(allocs[body[16]])
            return struct.pack("<IQ", hkvd.shm.register_memfd(client, m.fd, m.size), m.size)
        return real_raw(client, op, body, flags)

    monkeypatch.setattr(region, "raw_call", raw_call)
    return allocs


@pytest.mark.parametrize("dedupe", ["module", "table"])
@pytest.mark.parametrize("opt", ["rowwise_adagrad", "sgd"])
def test_modules_over_simulated_cuda_ipc(daemon, monkeypatch, opt, dedupe):
    """Embedding's cuda-ipc path (keys, rows, gradients and found in one
    registered allocation per cache, apply_gradients on it, prefetch with
    its own buffers, prefetched rows patched with the values the step
    returns) trains exactly as over shm, bit for bit."""
    from hkvd.torch import Embedding, Prefetcher

    allocs = _simulate_cuda(monkeypatch)
    c = daemon.client()
    fields, vocab, dim = 3, 50, 4
    losses = {}
    for name, transport in (("ipc", "cuda-ipc"), ("shm", "shm")):
        c.create_table(name, dim=dim, capacity=1 << 12, optimizer=opt)
        emb = Embedding(c, name, lr=0.1, transport=transport, events=False, verbose=False, max_batch=256,
                        dedupe=dedupe)
        assert emb.cache.transport == transport
        model = _Model(emb, fields, dim, 3)
        bce = torch.nn.BCEWithLogitsLoss()
        out = []
        for ids, y in Prefetcher(_data(8, 16, fields, vocab, 4), emb):
            loss = bce(model(ids), y)
            loss.backward()
            out.append(loss.detach())
        losses[name] = torch.stack(out)
        if dedupe == "module":
            assert emb.prefetch_hits == 8
            assert emb.patched_rows > 0, "consecutive batches share ids: the patch path ran"
        else:  # each lookup sent after the step before it: all but the first
            assert emb.prefetch_hits == 7
    assert len(allocs) >= 2, "the prefetch has buffers of its own"
    assert torch.equal(losses["ipc"], losses["shm"])
    ka, va, _ = c.export("ipc")
    kb, vb, _ = c.export("shm")
    assert np.array_equal(va[np.argsort(ka)].view(np.uint32), vb[np.argsort(kb)].view(np.uint32))
    c.close()


def test_embedding_bag_options_match_native(daemon):
    """include_last_offset and per_sample_weights (sum) as nn.EmbeddingBag
    takes them, outputs and gradients through the table (SGD, 1e-5), and a
    prefetch of the bag values."""
    from hkvd.torch import EmbeddingBag

    c = daemon.client()
    c.create_table("o", dim=3, capacity=1 << 10, optimizer="sgd")
    native = torch.nn.EmbeddingBag(50, 3, mode="sum", sparse=True, include_last_offset=True)
    w0 = native.weight.detach().clone()
    ours = EmbeddingBag(c, "o", mode="sum", include_last_offset=True, lr=0.3, init=lambda ids: w0[ids],
                        verbose=False, dedupe="module")
    o = torch.optim.SGD(native.parameters(), lr=0.3)
    values = torch.tensor([1, 2, 3, 4, 5, 1, 2])
    offsets = torch.tensor([0, 2, 2, 7])  # 3 bags, the second empty
    weights = torch.tensor([0.5, 2.0, 1.0, -1.0, 0.25, 3.0, 1.5])
    ours.prefetch(values)
    got = ours(values, offsets, per_sample_weights=weights)
    want = native(values, offsets, per_sample_weights=weights)
    assert got.shape == (3, 3) and torch.allclose(got, want, atol=1e-6)
    assert ours.prefetch_hits == 1
    target = torch.randn(3, 3)
    (got * target).sum().backward()
    (want * target).sum().backward()
    o.step()
    v, found = c.find("o", np.arange(1, 6, dtype=np.uint64))
    assert found.all() and torch.allclose(torch.from_numpy(v), native.weight.detach()[1:6], atol=1e-5)
    with pytest.raises(ValueError, match="need mode sum"):
        EmbeddingBag(c, "o", mode="mean", verbose=False)(values, offsets, per_sample_weights=weights)
    # Bad offsets and weights are refused as nn.EmbeddingBag refuses them,
    # before the lookup inserts any id.
    bag = EmbeddingBag(c, "o", mode="sum", verbose=False)
    fresh = torch.tensor([40, 41, 42])
    for off, err, match in [
        (torch.tensor([1, 2]), ValueError, r"offsets\[0\] must be 0"),
        (torch.tensor([0, 2, 1]), ValueError, "must not decrease"),
        (torch.tensor([0, 5]), ValueError, "last value must be <= 3"),
        (torch.tensor([0.0, 1.0]), TypeError, "integer tensor"),
        (torch.tensor([[0, 1]]), ValueError, "1-D"),
    ]:
        with pytest.raises(err, match=match):
            bag(fresh, off)
    with pytest.raises(ValueError, match="last value must be = 3"):
        EmbeddingBag(c, "o", mode="sum", include_last_offset=True, verbose=False)(fresh, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="per_sample_weights must have the input's shape"):
        bag(fresh, torch.tensor([0, 1]), per_sample_weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"input's shape \(2, 2\)"):
        bag(torch.tensor([[40, 41], [42, 43]]), per_sample_weights=torch.ones(4))
    assert not c.find("o", np.arange(40, 44, dtype=np.uint64))[1].any(), "no id of a refused batch was inserted"
    # Empty offsets are no bags, as nn.EmbeddingBag answers them (the ids
    # not looked up); with include_last_offset they are refused, as there.
    empty = torch.tensor([], dtype=torch.int64)
    assert bag(fresh, empty).shape == (0, 3) == torch.nn.EmbeddingBag(50, 3, mode="sum")(fresh, empty).shape
    with pytest.raises(ValueError, match="at least one value"):
        EmbeddingBag(c, "o", mode="sum", include_last_offset=True, verbose=False)(empty, empty)
    assert not c.find("o", np.arange(40, 44, dtype=np.uint64))[1].any()
    c.close()


def test_a_step_sent_without_waiting_is_read_before_the_next_request(daemon):
    """The backward sends its apply_gradients without waiting; the next
    request of the same client (here a plain find) reads that answer first
    and sees the step's rows; ``flush`` makes them visible to another
    connection."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("deferred", dim=4, capacity=1 << 10, optimizer="sgd")
    emb = Embedding(c, "deferred", lr=0.5, transport="shm", verbose=False)
    keys = np.array([1, 2, 3], dtype=np.uint64)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    assert emb.cache._inflight is not None, "sent, its answer not read yet"
    v, found = c.find("deferred", keys)
    assert emb.cache._inflight is None and found.all()
    assert np.array_equal(v[:, :4], np.full((3, 4), -0.5, np.float32))
    emb(torch.tensor([1, 2, 3])).sum().backward()
    emb.flush()
    other = daemon.client()
    v, _ = other.find("deferred", keys)
    assert np.array_equal(v[:, :4], np.full((3, 4), -1.0, np.float32))
    assert emb.step == 2 and emb.missing == 0
    other.close()
    c.close()


def test_float_ids_are_refused(daemon):
    """A float tensor of ids is refused (1.5 would be read as id 1)."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("fl", dim=2, capacity=1024, optimizer="sgd")
    emb = Embedding(c, "fl", verbose=False)
    with pytest.raises(TypeError, match="integer tensor"):
        emb(torch.tensor([1.5]))
    with pytest.raises(TypeError, match="integer"):
        EmbeddingCache(c, "fl", verbose=False).lookup(np.array([1.5]))
    assert emb(torch.tensor([1, 2])).shape == (2, 2)
    c.close()


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_failed_step_patches_no_prefetched_row(daemon, transport):
    """A step the daemon refuses (here a negative learning rate) wrote
    nothing: the prefetch pending meanwhile keeps the rows it read, so the
    forward after it sees the stored rows, not what the step's buffers
    held from an earlier step."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("failed", dim=4, capacity=1 << 12, optimizer="adam")
    m = Embedding(c, "failed", lr=0.1, init=lambda i: (i % 7).float()[:, None].expand(-1, 4) / 7,
                  transport=transport, verbose=False)
    a1, a2, a3 = torch.tensor([10, 11, 12]), torch.tensor([20, 21, 22]), torch.tensor([20, 21, 22, 30])
    m.prefetch(a1)
    m.prefetch(a2)
    m(a1).sum().backward()
    m.prefetch(a3)
    out = m(a2)
    m.lr = -1.0
    with pytest.raises(hkvd.BadRequest, match="lr") as refused:
        out.sum().backward()
        m.flush()
    if transport == "shm":  # the socket transport's backward waits: the error is its own
        assert "optimizer step of table 'failed'" in str(refused.value)
    m.lr = 0.1
    rows = m(a3).detach()
    stored, found = c.find("failed", a3.numpy().astype(np.uint64))
    assert found.all()
    assert torch.equal(rows, torch.from_numpy(stored[:, :4])), "the forward's rows are the stored rows"
    c.close()


@pytest.mark.parametrize("dedupe", ["module", "table"])
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_modules_sharing_a_table_train_prefetched_bit_identical(daemon, transport, dedupe):
    """Two modules over one table (an Embedding for two fields, an
    EmbeddingBag for a third, the same ids in all), one of them a step
    behind the other: prefetched through Prefetcher, every loss and every
    stored row equal an unprefetched run's bit for bit (a step of either
    module patches the prefetches pending in both); and a batch too large to
    prefetch leaves the next batch's prefetch in place."""
    from hkvd.torch import Embedding, EmbeddingBag, Prefetcher

    dim, vocab = 4, 40
    c = daemon.client()
    runs = {}
    for name, ahead in (("share_plain", False), ("share_ahead", True)):
        c.create_table(name, dim=dim, capacity=1 << 12, optimizer="adam")
        init = lambda i: (i % 11).float()[:, None].expand(-1, dim) / 11  # noqa: E731
        a = Embedding(c, name, lr=0.05, init=init, transport=transport, verbose=False, max_batch=16, dedupe=dedupe)
        b = EmbeddingBag(c, name, mode="sum", lr=0.05, init=init, transport=transport, verbose=False, max_batch=16,
                         dedupe=dedupe)
        torch.manual_seed(3)
        mlp = torch.nn.Sequential(torch.nn.Linear(3 * dim, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        dense = torch.optim.SGD(mlp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(5)
        data = []
        for step in range(30):
            n = 40 if step % 7 == 3 else 4  # now and then a batch of more distinct ids than max_batch
            ids = (vocab * torch.rand((n, 4), generator=g) ** 2).long()
            data.append((ids, (ids[:, 0] % 2).float()))
        it = Prefetcher(data, [(a, lambda d: d[0][:, :2]), (b, lambda d: d[0][:, 2:])]) if ahead else data
        losses = []
        for ids, y in it:
            x = torch.cat([a(ids[:, :2]).flatten(1), b(ids[:, 2:])], 1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(mlp(x).squeeze(1), y)
            dense.zero_grad()
            loss.backward()
            dense.step()
            losses.append(loss.detach())
        runs[name] = (torch.stack(losses), a, b)
    assert torch.equal(runs["share_plain"][0], runs["share_ahead"][0]), "losses bit for bit"
    ka, va, _ = c.export("share_plain")
    kb, vb, _ = c.export("share_ahead")
    oa, ob = np.argsort(ka), np.argsort(kb)
    assert ka.size > 0 and np.array_equal(ka[oa], kb[ob])
    assert np.array_equal(va[oa].view(np.uint32), vb[ob].view(np.uint32)), "rows (values and state) bit for bit"
    _, a, b = runs["share_ahead"]
    small_a = sum(1 for ids, _ in data if ids[:, :2].unique().numel() <= 16)
    small_b = sum(1 for ids, _ in data if ids[:, 2:].unique().numel() <= 16)
    assert 0 < small_a < 30, "some batches too large to prefetch"
    if dedupe == "module":
        assert (a.prefetch_hits, b.prefetch_hits) == (small_a, small_b), "every batch prefetched was used"
        assert a.patched_rows > 0 and b.patched_rows > 0
    else:
        # Sent after the step before: all but the first batch's; a step of
        # either module sends both modules' pending lookups again.
        assert (a.prefetch_hits, b.prefetch_hits) == (small_a - 1, small_b - 1), "every batch prefetched was used"
    c.close()


@pytest.mark.parametrize("dedupe", ["module", "table"])
@pytest.mark.parametrize("transport", ["shm", "socket", "cuda-ipc"])
def test_one_module_twice_a_step_prefetched_is_bit_identical(daemon, monkeypatch, transport, dedupe):
    """One module used for two fields of a step (two forwards, so two
    optimizer steps in one backward) with the next batch prefetched: the
    second step's patch copied the first step's updated rows out of the
    cache's buffers before the first step's answer was read, and the
    prefetched forward got stale rows, over shm even optimizer state
    (found by an independent tester: 29 of 30 forwards differed from the
    table with SGD). Every forward's rows equal the table's, and the run
    equals an unprefetched one bit for bit."""
    from hkvd.torch import Embedding, Prefetcher

    if transport == "cuda-ipc":
        _simulate_cuda(monkeypatch)
    dim = 4
    c, check = daemon.client(), daemon.client()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 40, (32,), generator=g), torch.randint(0, 40, (32,), generator=g)) for _ in range(20)]
    w = [torch.randn(32, dim, generator=g) for _ in data]
    runs = {}
    for name, ahead in (("twice_plain", False), ("twice_ahead", True)):
        c.create_table(name, dim=dim, capacity=1 << 12, optimizer="adagrad")
        e = Embedding(c, name, lr=0.05, init=lambda i: (i % 7).float()[:, None].expand(-1, dim) / 7,
                      transport=transport, verbose=False, events=transport != "cuda-ipc", dedupe=dedupe)
        stale = 0
        for step, (users, items) in enumerate(Prefetcher(data, e) if ahead else data):
            u = e(users)
            e.flush()
            truth = check.find(name, users.numpy().astype(np.uint64))[0][:, :dim]
            stale += not np.array_equal(u.detach().numpy(), truth)
            ((u + e(items)) * w[step]).sum().backward()
        e.flush()
        assert stale == 0, f"{stale} of {len(data)} forwards got rows other than the table's"
        runs[name] = e
    # The table's deduplication sends each lookup after the step before it.
    assert runs["twice_ahead"].prefetch_hits == len(data) - (dedupe == "table")
    ka, va, _ = c.export("twice_plain")
    kb, vb, _ = c.export("twice_ahead")
    oa, ob = np.argsort(ka), np.argsort(kb)
    assert ka.size > 0 and np.array_equal(ka[oa], kb[ob])
    assert np.array_equal(va[oa].view(np.uint32), vb[ob].view(np.uint32)), "rows (values and state) bit for bit"
    c.close()
    check.close()


@pytest.mark.parametrize("transport", ["shm", "cuda-ipc"])
def test_modules_of_one_table_on_two_clients_step_in_backward_order(daemon, monkeypatch, transport):
    """Two Adam modules over one table on two connections, both stepped in
    one backward: the second's step is sent once the first's is answered,
    so the steps run in backward order and every run is the same (over shm
    an independent tester saw six runs give six different tables: the two
    steps, sent without waiting on two connections, ran in either order)."""
    from hkvd.torch import Embedding

    if transport == "cuda-ipc":
        _simulate_cuda(monkeypatch)
    dim = 4
    ids = torch.tensor([1, 2, 3, 2])
    tables = []
    for run in range(4):
        name = f"two_clients_{run}"
        ca, cb = daemon.client(), daemon.client()
        ca.create_table(name, dim=dim, capacity=1024, optimizer="adam")
        kw = dict(lr=0.1, init=lambda i: i.float()[:, None].expand(-1, dim) / 4, transport=transport, verbose=False,
                  events=transport != "cuda-ipc")
        a, b = Embedding(ca, name, **kw), Embedding(cb, name, **kw)
        g = torch.Generator().manual_seed(2)
        for _ in range(6):
            a.flush()
            b.flush()
            w = torch.randn(4, dim, generator=g)
            ((a(ids) * w).sum() + (b(ids) * w * 2).sum()).backward()
        a.flush()
        b.flush()
        k, v, _ = ca.export(name)
        tables.append(v[np.argsort(k)].view(np.uint32).copy())
        ca.close()
        cb.close()
    assert all(np.array_equal(tables[0], t) for t in tables[1:]), "every run the same table, bit for bit"


@pytest.mark.parametrize("dedupes", [("table", "table"), ("module", "table"), ("table", "module")])
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_modules_of_one_table_on_two_clients_prefetched_read_the_table(daemon, transport, dedupes):
    """Two modules over one table on two connections, each prefetching its
    next batch: every forward's rows are the table's rows at that moment.
    A step of one module sends the other module's pending lookup again on
    the other connection, where (found by an independent tester, over shm)
    it ran before the step it should follow: 15-20 of 40 forwards got
    rows from before the other module's step."""
    from hkvd.torch import Embedding

    dim = 4
    ca, cb, check = daemon.client(), daemon.client(), daemon.client()
    name = f"two_pf_{transport}_{dedupes[0]}_{dedupes[1]}"
    ca.create_table(name, dim=dim, capacity=1 << 12, optimizer="sgd")
    kw = dict(lr=0.5, init=lambda i: (i % 5).float()[:, None].expand(-1, dim) / 5, transport=transport,
              verbose=False)
    a = Embedding(ca, name, dedupe=dedupes[0], **kw)
    b = Embedding(cb, name, dedupe=dedupes[1], **kw)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 30, (64,), generator=g), torch.randint(0, 30, (64,), generator=g))
               for _ in range(16)]
    stale = 0
    for t, (ia, ib) in enumerate(batches):
        if t + 1 < len(batches):
            a.prefetch(batches[t + 1][0])
            b.prefetch(batches[t + 1][1])
        ra, rb = a(ia), b(ib)
        a.flush()
        b.flush()
        for ids, rows in ((ia, ra), (ib, rb)):
            truth = check.find(name, ids.numpy().astype(np.uint64))[0][:, :dim]
            stale += not np.array_equal(rows.detach().numpy(), truth)
        w = torch.randn(64, dim, generator=g)
        ((ra * w).sum() + (rb * w).sum()).backward()
    a.flush()
    b.flush()
    assert stale == 0, f"{stale} of {2 * len(batches)} forwards got rows other than the table's"
    assert a.prefetch_hits + b.prefetch_hits > 0
    for c in (ca, cb, check):
        c.close()


@pytest.mark.parametrize("dedupe", ["table", "module"])
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_refused_step_is_not_counted(daemon, transport, dedupe):
    """A step the table refuses writes nothing and does not count: the next
    step applied is the one after the last applied (Adam's bias correction
    goes on from it). Found by an independent tester: after one refused
    step the count was 2 after the next good one."""
    from hkvd.torch import Embedding

    c = daemon.client()
    name = f"refused_{transport}_{dedupe}"
    c.create_table(name, dim=2, capacity=1024, optimizer="adam")
    emb = Embedding(c, name, lr=0.1, transport=transport, verbose=False, dedupe=dedupe)
    emb(torch.tensor([1, 2])).sum().backward()
    emb.flush()
    assert emb.step == 1
    emb.lr = float("nan")  # refused by the table at the step
    with pytest.raises(hkvd.HkvdError, match="lr"):
        emb(torch.tensor([1, 2])).sum().backward()
        emb.flush()  # over shm the refusal is read here
    assert emb.step == 1, "the refused step is not counted"
    emb.lr = 0.1
    emb(torch.tensor([1, 2])).sum().backward()
    emb.flush()
    assert emb.step == 2
    c.close()


def test_the_step_count_is_kept_in_the_state_dict(daemon):
    """A module's state_dict keeps the optimizer's step count, so that a
    run resumed into a new module (the rows are the table's) continues
    Adam's bias correction where it was: 4 + 4 steps equal 8 bit for bit
    (an independent tester found the count restarting at 0: the resumed
    rows differed by 0.033). A state_dict without the count (saved before
    it was kept) still loads."""
    from hkvd.torch import Embedding

    dim = 4
    c = daemon.client()
    ids = torch.tensor([1, 2, 3])
    g = torch.Generator().manual_seed(4)
    w = [torch.randn(3, dim, generator=g) for _ in range(8)]
    init = lambda i: i.float()[:, None].expand(-1, dim) / 3  # noqa: E731
    for name in ("resume_whole", "resume_split"):
        c.create_table(name, dim=dim, capacity=1024, optimizer="adam")
    e = Embedding(c, "resume_whole", lr=0.05, init=init, verbose=False)
    for x in w:
        (e(ids) * x).sum().backward()
    a = Embedding(c, "resume_split", lr=0.05, init=init, verbose=False)
    for x in w[:4]:
        (a(ids) * x).sum().backward()
    saved = torch.nn.Sequential(a).state_dict()
    assert saved["0._extra_state"] == {"step": 4}
    b = torch.nn.Sequential(Embedding(c, "resume_split", lr=0.05, init=init, verbose=False))
    b.load_state_dict(saved)
    assert b[0].step == 4
    for x in w[4:]:
        (b[0](ids) * x).sum().backward()
    e.flush()
    b[0].flush()
    va, vb = c.find("resume_whole", [1, 2, 3])[0], c.find("resume_split", [1, 2, 3])[0]
    assert np.array_equal(va.view(np.uint32), vb.view(np.uint32))
    old = Embedding(c, "resume_split", lr=0.05, verbose=False)
    torch.nn.Sequential(old).load_state_dict({})  # saved before the count was kept
    assert old.step == 0
    c.close()


def test_a_reserved_id_is_named_by_its_place_in_the_forwards_ids(daemon):
    """-1, a common padding id, is reserved: the error names its index in
    the ids the forward was given (an independent tester saw index 0, its
    place among the sorted distinct ids), and the module stays usable."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("rk", dim=4, capacity=1024, optimizer="sgd")
    e = Embedding(c, "rk", lr=0.1, verbose=False)
    for ids, at in ((torch.tensor([3, 5, -1]), 2), (torch.tensor([[7, 8], [9, -2]]), 3)):
        with pytest.raises(hkvd.ReservedKey, match=f"at index {at} of the ids"):
            e(ids)
    assert e(torch.tensor([1, 2])).shape == (2, 4)
    c.close()


def test_a_custom_policy_table_is_refused_by_the_constructor(daemon):
    """A table whose writes need the caller's scores (policy custom) is
    refused when the module is made, not at its first forward (where an
    independent tester met ScoresError)."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("cust", dim=4, capacity=1024, policy="custom", optimizer="sgd")
    assert c.policy("cust") == "custom"
    with pytest.raises(ValueError, match="policy custom"):
        Embedding(c, "cust", verbose=False)
    c.close()


@pytest.mark.parametrize("dedupe", ["table", "module"])
def test_a_module_made_after_a_restart_ignores_the_dead_connections_modules(tmp_path, dedupe):
    """The daemon killed with a step in flight and started again: a new
    module on a new client trains, while the old module (on the dead
    connection) is still alive. Its first forward raised the old module's
    ConnectionLost (an independent tester's finding: the modules of a
    table are found by socket path and table)."""
    import signal

    from conftest import Daemon
    from hkvd.torch import Embedding

    d = Daemon(tmp_path)
    c = d.client()
    c.create_table("rs", dim=4, capacity=4096, optimizer="adam")
    old = Embedding(c, "rs", lr=0.01, verbose=False, transport="shm", dedupe=dedupe)
    ids = [torch.randint(0, 50, (4, 2), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    old(ids[0]).sum().backward()
    old.prefetch(ids[1])
    old(ids[1]).sum().backward()  # its step unanswered
    old.prefetch(ids[2])
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(timeout=30)
    d = Daemon(tmp_path)
    try:
        c2 = d.client()
        c2.create_table("rs", dim=4, capacity=4096, optimizer="adam")
        new = Embedding(c2, "rs", lr=0.01, verbose=False, transport="shm", dedupe=dedupe)
        for x in ids[2:]:
            new.prefetch(x)
            new(x).sum().backward()
        new.flush()
        assert new.step == 4
        with pytest.raises(hkvd.ConnectionLost):  # the old module is done
            old(ids[3]).sum().backward()
        c2.close()
    finally:
        d.stop()


def test_a_failed_shared_memory_setup_leaves_no_region(tmp_path):
    """A module whose shared-memory buffers the daemon refuses (here past
    limits.max_region_bytes_per_connection, 8 MiB: the 512 KiB of keys
    fit, the 48 MiB of rows do not) falls back to the socket and keeps
    none of them: the keys buffer registered before the refusal stayed
    registered for the module's life (an independent tester's finding,
    512 MiB)."""
    import gc

    from conftest import Daemon
    from hkvd.torch import Embedding

    d = Daemon(tmp_path, "--max-region-bytes-per-connection", str(8 << 20))
    try:
        c = d.client()
        c.create_table("big", dim=64, capacity=4096, optimizer="adam")
        e = Embedding(c, "big", lr=0.01, verbose=False, max_batch=1 << 16)
        assert e.transport == "socket"
        gc.collect()
        e(torch.tensor([1])).sum().backward()
        e.flush()
        assert c.stats()["regions"]["regions"] == 0
        c.close()
    finally:
        d.stop()


@pytest.mark.parametrize("dedupe", ["table", "module"])
def test_prefetcher_serves_an_evaluation_loop(daemon, dedupe):
    """Under torch.no_grad() no backward sends the next lookup: with dedupe
    "table" the prefetch is sent at once (an independent tester saw 0
    prefetch hits in an evaluation loop), and the rows are the table's."""
    from hkvd.torch import Embedding, Prefetcher

    c = daemon.client()
    c.create_table("ev", dim=4, capacity=4096, optimizer="adagrad")
    e = Embedding(c, "ev", lr=0.1, verbose=False, dedupe=dedupe,
                  init=lambda i: i.float()[:, None].expand(-1, 4) / 7)
    train = [(torch.tensor([i, i + 1, 5]),) for i in range(4)]
    for (ids,) in Prefetcher(train, e):
        e(ids).sum().backward()
    hits = e.prefetch_hits
    val = [(torch.tensor([i, 7 + i, 5]),) for i in range(5)]
    with torch.no_grad():
        for (ids,) in Prefetcher(val, e):
            got = e(ids)
            want = torch.from_numpy(c.find("ev", ids.numpy().astype(np.uint64))[0][:, :4])
            assert torch.equal(got, want)
    assert e.prefetch_hits - hits >= 4
    (ids,) = train[0]
    e(ids).sum().backward()  # training goes on after the evaluation
    e.flush()
    assert e.step == 5
    c.close()


@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_a_table_made_again_with_rows_as_wide_is_named_at_the_step(daemon, transport):
    """A table dropped and made again with another dim and optimizer but
    rows as wide (dim 4 sgd, then dim 2 adagrad: 4 floats a row) by
    another client: the next forward says the table was made again (an
    independent tester got only the daemon's 'grads has 4 elements but 2
    are needed' from the socket's backward; the forward before it read the
    new rows as the old table's)."""
    from hkvd.torch import Embedding

    c, c2 = daemon.client(), daemon.client()
    c.create_table("sw", dim=4, capacity=1024, optimizer="sgd")
    e = Embedding(c, "sw", lr=0.1, verbose=False, transport=transport)
    e(torch.tensor([1])).sum().backward()
    e.flush()
    c2.drop_table("sw")
    c2.create_table("sw", dim=2, capacity=1024, optimizer="adagrad")
    with pytest.raises(hkvd.UnknownTable, match="dropped and created again since this module was made"):
        e(torch.tensor([1])).sum().backward()
        e.flush()
    c.close()
    c2.close()


def test_prefetcher_takes_a_tensor_batch_whole_and_refuses_a_dict(daemon):
    """The default ids of a batch: a tensor batch is its own ids (its first
    row was taken: an independent tester's finding), a dict batch is
    refused saying how to name its ids (a bare KeyError: 0 before)."""
    from hkvd.torch import Embedding, Prefetcher

    c = daemon.client()
    c.create_table("pb", dim=4, capacity=4096, optimizer="sgd")
    e = Embedding(c, "pb", lr=0.1, verbose=False)
    batches = [torch.tensor([[i, i + 1], [i + 2, i + 3]]) for i in range(0, 40, 10)]
    for ids in Prefetcher(batches, e):
        e(ids).sum().backward()
    assert e.prefetch_hits == 3
    with pytest.raises(TypeError, match="dict"):
        for b in Prefetcher([{"ids": torch.tensor([1])}], e):
            pass
    c.close()


def test_shared_memory_that_cannot_be_made_names_max_batch(daemon, monkeypatch):
    """Buffers for a max_batch the host cannot map: the error names
    max_batch and the bytes (an independent tester got a bare
    "[Errno 12] Cannot allocate memory")."""
    import errno

    import hkvd.torch as ht

    c = daemon.client()
    c.create_table("nm", dim=4, capacity=4096, optimizer="sgd")

    def no_memory(shape, dtype=np.float32):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(ht, "shm_array", no_memory)
    with pytest.raises(OSError, match=r"max_batch 1024 \(.* bytes of buffers\).*lower max_batch"):
        ht.Embedding(c, "nm", lr=0.1, verbose=False, transport="shm", max_batch=1024)
    e = ht.Embedding(c, "nm", lr=0.1, verbose=False, max_batch=1024)  # auto: the socket
    assert e.transport == "socket"
    c.close()


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_batch_above_the_frame_bound_is_split(tmp_path, monkeypatch, transport):
    """A module whose max_batch would make a request larger than the
    daemon's limits.max_frame_bytes splits its batches instead of getting
    ``oversized`` (an independent tester's finding, a socket module with
    max_batch 2^26). Here the bound is 64 KiB on both sides."""
    import hkvd.torch as ht
    from conftest import Daemon

    d = Daemon(tmp_path, "--max-frame-bytes", "65536")
    try:
        monkeypatch.setattr(ht, "_MAX_FRAME_BYTES", 65536)
        c = d.client()
        c.create_table("f", dim=8, capacity=1 << 14, optimizer="sgd")
        e = ht.Embedding(c, "f", lr=0.5, transport=transport, verbose=False, max_batch=1 << 20)
        assert e.transport == transport
        ids = torch.arange(5000)  # 5000 × (8 + 32) bytes a request: above 64 KiB
        e(ids).sum().backward()
        e.flush()
        for s in range(0, 5000, 1000):
            assert np.allclose(c.find("f", np.arange(s, s + 1000, dtype=np.uint64))[0][:, :8], -0.5)
        assert e.cache.max_batch == ht._frame_keys(8) < 5000
        c.close()
    finally:
        d.stop()


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_closed_clients_module_leaves_the_tables_modules(daemon, transport):
    """A module whose client was closed with a prefetch pending is none of
    the table's modules: a tester's new module on a new client sent that
    lookup again on the closed socket and got ``Bad file descriptor``,
    after its own step was applied."""
    from hkvd.torch import Embedding, Prefetcher

    c1 = daemon.client()
    c1.create_table("cl", dim=3, capacity=4096, optimizer="sgd")
    m1 = Embedding(c1, "cl", lr=0.1, transport=transport, verbose=False)
    batches = [(torch.tensor([1, 2]),), (torch.tensor([2, 3]),), (torch.tensor([3, 4]),)]
    for i, (ids,) in enumerate(Prefetcher(batches, m1)):
        m1(ids).sum().backward()
        if i == 1:
            break  # an early stop leaves a prefetch pending
    m1.flush()
    c1.close()
    c2 = daemon.client()
    before = c2.find("cl", np.array([1, 2], dtype=np.uint64))[0][:, :3].copy()
    m2 = Embedding(c2, "cl", lr=0.1, transport=transport, verbose=False)
    m2(torch.tensor([1, 2])).sum().backward()
    m2.flush()
    after = c2.find("cl", np.array([1, 2], dtype=np.uint64))[0][:, :3]
    assert np.allclose(after, before - 0.1)
    c2.close()


def test_flush_after_a_lost_connection_raises(tmp_path):
    """``flush()`` on a module whose connection was lost raises
    ``ConnectionLost`` (a tester's ``finally: flush()`` returned normally
    after the daemon was killed)."""
    from conftest import Daemon
    from hkvd.torch import Embedding

    d = Daemon(tmp_path)
    c = d.client()
    c.create_table("lo", dim=4, capacity=4096, optimizer="sgd")
    e = Embedding(c, "lo", lr=0.1, verbose=False)
    e(torch.tensor([1, 2])).sum().backward()
    d.proc.kill()
    d.proc.wait()
    with pytest.raises(hkvd.ConnectionLost):
        for _ in range(3):
            e(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(hkvd.ConnectionLost, match="was lost"):
        e.flush()


def test_a_module_refused_at_construction_makes_no_buffers(daemon, capsys):
    """A module whose table is missing or has no optimizer, or whose
    arguments are refused, says so before it sets up a transport (a tester
    saw the transport line printed, and shared memory made, first); a
    missing table's error says to create it."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("plain", dim=4, capacity=4096)
    c.create_table("opt", dim=4, capacity=4096, optimizer="sgd")
    with pytest.raises(hkvd.UnknownTable, match="create it first"):
        Embedding(c, "missing")
    with pytest.raises(ValueError, match="no optimizer"):
        Embedding(c, "plain")
    with pytest.raises(ValueError, match="not a finite number"):
        Embedding(c, "opt", lr=float("nan"))
    assert "hkvd.torch" not in capsys.readouterr().err
    assert c.stats()["regions"]["regions"] == 0
    c.close()


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_table_made_again_as_wide_is_refused_not_read(daemon, transport):
    """A table dropped and created again by another client with rows as
    wide (adagrad dim 8, then sgd dim 16: 16 floats a row) and rows of
    its own: the module's next forward is refused, and every one after
    it, instead of reading the new rows' columns as its values and state
    (a tester's forward succeeded; the step failed later, or, with the
    same spec, never)."""
    from hkvd.torch import Embedding

    c, c2 = daemon.client(), daemon.client()
    c.create_table("wide", dim=8, capacity=1024, optimizer="adagrad")
    e = Embedding(c, "wide", lr=0.1, verbose=False, transport=transport)
    e(torch.tensor([1, 2])).sum().backward()
    e.flush()
    c2.drop_table("wide")
    c2.create_table("wide", dim=16, capacity=1024, optimizer="sgd")
    c2.insert_or_assign("wide", np.array([1, 2], np.uint64), np.full((2, 16), 7.0, np.float32))
    for _ in range(2):
        with pytest.raises(hkvd.UnknownTable, match="dropped and created again"):
            e(torch.tensor([1, 2]))
    # A new module over the new table works.
    e2 = Embedding(c, "wide", lr=0.1, verbose=False, transport=transport)
    assert torch.equal(e2(torch.tensor([1])), torch.full((1, 16), 7.0))
    c.close()
    c2.close()


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_an_embedding_cache_of_a_table_made_again_keeps_refusing(daemon, transport):
    """An EmbeddingCache whose table another client dropped and created
    again with rows as wide: every request after the daemon's one refusal
    is refused too (the cache's dims are the old table's), where the
    second one read the new table's rows."""
    c, c2 = daemon.client(), daemon.client()
    c.create_table("ec", dim=8, capacity=1024, optimizer="adagrad")
    cache = EmbeddingCache(c, "ec", device="cpu", transport=transport, verbose=False)
    cache.lookup(torch.tensor([1, 2]))
    c2.drop_table("ec")
    c2.create_table("ec", dim=16, capacity=1024, optimizer="sgd")
    for _ in range(2):
        with pytest.raises(hkvd.UnknownTable, match="dropped and created again"):
            cache.lookup(torch.tensor([1, 2]))
    with pytest.raises(hkvd.UnknownTable, match="dropped and created again"):
        cache.optimizer_step(torch.tensor([1]), torch.ones((1, 8)), lr=0.1)
    assert EmbeddingCache(c, "ec", device="cpu", transport=transport, verbose=False).dim == 16
    c.close()
    c2.close()


def _found_rows(c, table, keys):
    """The values of ``keys`` (found ones) and their found flags."""
    values, found = c.find(table, keys)
    return values[:, :c.value_dim(table)], found


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_refused_prefetch_neither_hangs_nor_takes_a_step(daemon, monkeypatch, transport):
    """An independent tester prefetched [-1] (dedupe "table"), then stepped
    and looked up other ids: the forward dropped the refused lookup, whose
    error escaped from the next backward (naming the index among the
    prefetched ids), which lost its step while module.step counted it,
    and left the lookup in the pending list, so the backward after it
    read its spent answer again and blocked forever. Now prefetch()
    refuses reserved ids on the CPU at once, and a lookup that the daemon
    refuses (ids on a GPU are not read by prefetch(): simulated here) is
    dropped once, unused, or fails the forward that uses it; every step
    is applied and counted. The client times out, so a hang fails."""
    from hkvd.torch import Embedding

    c = hkvd.Client(daemon.socket, timeout=10)
    c.create_table("hang", dim=4, capacity=1024, optimizer="sgd")
    e = Embedding(c, "hang", lr=1.0, transport=transport, verbose=False)
    e(torch.tensor([1])).sum().backward()
    with pytest.raises(hkvd.ReservedKey, match="index 1 of the ids given to prefetch"):
        e.prefetch(torch.tensor([3, -1]))
    monkeypatch.setattr(hkvd.torch, "_readable", lambda t: False)  # as ids on a GPU
    e.prefetch(torch.tensor([-1]))
    e(torch.tensor([1])).sum().backward()  # sends the lookup of [-1] behind the step
    e(torch.tensor([2])).sum().backward()  # drops it unused
    e(torch.tensor([7])).sum().backward()
    e.flush()
    assert e.step == 4
    values, found = _found_rows(c, "hang", [1, 2, 7])
    assert found.all() and values[:, 0].tolist() == [-2.0, -1.0, -1.0]
    # A refused lookup that the forward uses fails that forward, naming
    # the id's place in its ids; no step is counted, the module goes on.
    e.prefetch(torch.tensor([5, -1]))
    e(torch.tensor([1])).sum().backward()
    with pytest.raises(hkvd.ReservedKey, match="at index 1 of the ids .* prefetch"):
        e(torch.tensor([5, -1]))
    e(torch.tensor([5])).sum().backward()
    e.flush()
    assert e.step == 6
    values, found = _found_rows(c, "hang", [1, 5])
    assert found.all() and values[:, 0].tolist() == [-3.0, -1.0]
    # A refused step with a lookup to send behind it is still the
    # backward's (or the flush's) error, and is not counted.
    e.lr = float("nan")
    e.prefetch(torch.tensor([5]))
    with pytest.raises(hkvd.BadRequest, match="lr"):
        e(torch.tensor([1])).sum().backward()
        e.flush()
    assert e.step == 6
    e.lr = 1.0
    e(torch.tensor([5])).sum().backward()
    e.flush()
    assert e.step == 7 and _found_rows(c, "hang", [1, 5])[0][:, 0].tolist() == [-3.0, -2.0]
    c.close()


@pytest.mark.parametrize("dedupe", ["table", "module"])
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_dropped_prefetchs_refusal_leaves_the_module_in_step(daemon, monkeypatch, transport, dedupe):
    """Whatever error the daemon answers to a prefetched lookup that no
    forward uses, its answer is read once and the module's pending
    lookups stay in step with the connection: here an unknown table
    (dropped behind the module, then made again by the module's own
    client, so that the daemon does not call it made again) refuses the
    prefetch, and the steps after it are applied and counted."""
    from hkvd.torch import Embedding

    c = hkvd.Client(daemon.socket, timeout=10)
    c.create_table("gone", dim=2, capacity=1024, optimizer="sgd")
    e = Embedding(c, "gone", lr=1.0, transport=transport, verbose=False, dedupe=dedupe)
    e(torch.tensor([1])).sum().backward()
    e.flush()
    sent = []
    real = e.cache.__class__._send

    def send_to_nowhere(self, op, keys, rows, *a, **kw):
        # The prefetched lookups (on the module's spare caches) go to a
        # table that does not exist: the daemon refuses them.
        if self is not e.cache and op == hkvd.region.OP_FIND_OR_INSERT:
            sent.append(self.table)
            c.dim("gone")
            c._dims["nowhere"] = c._dims["gone"]  # else the client refuses it unsent
            c._specs["nowhere"] = c._specs["gone"]
            c._made["nowhere"] = c._made["gone"]  # else the cache calls "gone" made again
            self.table = "nowhere"
            try:
                return real(self, op, keys, rows, *a, **kw)
            finally:
                self.table = "gone"
        return real(self, op, keys, rows, *a, **kw)

    monkeypatch.setattr(e.cache.__class__, "_send", send_to_nowhere)
    for ids in ([4], [5], [6]):
        e.prefetch(torch.tensor([9]))  # never used
        e(torch.tensor(ids)).sum().backward()
    e(torch.tensor([1])).sum().backward()
    e.flush()
    assert sent, "the prefetches were sent"
    assert e.step == 5 and e.prefetch_hits == 0
    values, found = _found_rows(c, "gone", [1, 4, 5, 6])
    assert found.all() and values[:, 0].tolist() == [-2.0, -1.0, -1.0, -1.0]
    c.close()


@pytest.mark.parametrize("dedupe", ["table", "module"])
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_prefetcher_over_padded_batches(daemon, transport, dedupe):
    """A tester's loader padded batches with -1 and the forward clamped
    them; Prefetcher prefetched the raw ids. With dedupe "table" the
    refused lookup later cost a step and hung the loop; with "module" the
    refusal came out of the loop after a step. Now the first prefetch
    refuses at once (nothing looked up, no step); given the ids the
    forward takes, the loop trains exactly as one without prefetching."""
    from hkvd.torch import Embedding, Prefetcher

    c = hkvd.Client(daemon.socket, timeout=10)
    batches = [(torch.tensor([[1, 2], [3, -1]]) + k, torch.ones(2)) for k in range(4)]
    init = lambda i: (i.float()[:, None] / 7).expand(-1, 4).contiguous()  # noqa: E731
    for name in ("pad_raw", "pad_fetch", "pad_plain"):
        c.create_table(name, dim=4, capacity=1024, optimizer="adagrad")
    mods = {n: Embedding(c, n, lr=0.1, init=init, transport=transport, verbose=False, dedupe=dedupe)
            for n in ("pad_raw", "pad_fetch", "pad_plain")}

    def train(e, loader):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 1)
        for ids, y in loader:
            lin(e(ids.clamp(min=0)).flatten(1)).sum().backward()
        e.flush()

    raw = mods["pad_raw"]
    with pytest.raises(hkvd.ReservedKey, match="index 3 of the ids given to prefetch"):
        train(raw, Prefetcher(batches, raw))
    assert raw.step == 0
    assert not _found_rows(c, "pad_raw", np.arange(8))[1].any(), "nothing was looked up"
    train(raw, batches)  # the module goes on
    assert raw.step == 4
    fetch = mods["pad_fetch"]
    train(fetch, Prefetcher(batches, [(fetch, lambda b: b[0].clamp(min=0))]))
    train(mods["pad_plain"], batches)
    assert fetch.step == mods["pad_plain"].step == 4
    assert fetch.prefetch_hits == (3 if dedupe == "table" else 4)  # "table": the first step is not prefetched
    keys = np.arange(8)
    a, fa = _found_rows(c, "pad_fetch", keys)
    b, fb = _found_rows(c, "pad_plain", keys)
    assert fa.tolist() == fb.tolist() and fa[:7].all()
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    c.close()


@pytest.mark.parametrize("transport", ["shm", "socket"])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_write_back_keeps_optimizer_state_unless_told_to_reset_it(daemon, transport, opt):
    """An independent tester's write_back on an Adam (adagrad, row-wise
    Adagrad) table stored the values and zeroed the rows' optimizer state,
    silently. It is now refused on a table whose optimizer keeps state,
    leaving the rows as they were, unless reset_state=True, which zeroes
    it as asked; SGD has no state and writes as before."""
    c = daemon.client()
    name = f"wb_{opt}_{transport}"
    c.create_table(name, dim=2, capacity=1024, optimizer=opt)
    w = c.dim(name)
    before = np.arange(2 * w, dtype=np.float32).reshape(2, w) + 1
    c.insert_or_assign(name, [1, 2], before)
    cache = EmbeddingCache(c, name, transport=transport, verbose=False)
    new = torch.full((2, 2), 9.0)
    if w > 2:
        with pytest.raises(ValueError, match="reset_state=True"):
            cache.write_back(torch.tensor([1, 2]), new)
        assert np.array_equal(c.find(name, [1, 2])[0], before)
        cache.write_back(torch.tensor([1, 2]), new, reset_state=True)
    else:
        cache.write_back(torch.tensor([1, 2]), new)
    got = c.find(name, [1, 2])[0]
    assert np.array_equal(got[:, :2], np.full((2, 2), 9.0, np.float32))
    assert not got[:, 2:].any()
    c.close()


def test_a_refused_step_read_by_flush_says_so(daemon):
    """A tester's flush() after a refused step raised "(read before this
    request, which was not sent)", though flush sends no request: the
    error now says who read it (flush(), client.settle(), or the request
    it stopped). Over shm, where the backward does not wait for the step
    (over the socket the backward raises it itself)."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("fl", dim=2, capacity=1024, optimizer="sgd")
    m = Embedding(c, "fl", lr=0.1, transport="shm", verbose=False)
    for reader, said in (("flush", "read by flush()"), ("settle", "read by client.settle()"),
                         ("find", "which was not sent")):
        m.lr = -1.0
        m(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(hkvd.BadRequest) as e:
            {"flush": m.flush, "settle": c.settle, "find": lambda: c.find("fl", [1])}[reader]()
        assert said in e.value.message
        assert m.step == 0
        m.lr = 0.1
    c.close()


def test_an_adam_step_of_0_is_refused_before_sending(daemon):
    """EmbeddingCache.optimizer_step checks Adam's step from 1, as the
    client's apply_gradients does (the daemon refuses step 0)."""
    c = daemon.client()
    c.create_table("adam0", dim=2, capacity=64, optimizer="adam")
    cache = EmbeddingCache(c, "adam0", verbose=False)
    cache.lookup(torch.tensor([1]))
    with pytest.raises(ValueError, match=f"step must be 1 to {2**64 - 1}"):
        cache.optimizer_step(torch.tensor([1]), torch.ones(1, 2), lr=0.1, step=0)
    assert cache.optimizer_step(torch.tensor([1]), torch.ones(1, 2), lr=0.1, step=1) == 0
    c.close()


@pytest.mark.parametrize("dedupe", ["table", "module"])
def test_a_reserved_uint64_id_is_named_as_given(daemon, dedupe):
    """A tester's uint64 id 2**64 - 1 (torch.uint64 or np.uint64) was
    reported as "id -1": the forward and prefetch() now name it as the
    caller gave it; int64 ids keep their negative names."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table(f"u64_{dedupe}", dim=2, capacity=64, optimizer="sgd")
    e = Embedding(c, f"u64_{dedupe}", lr=0.1, verbose=False, dedupe=dedupe)
    for ids, named in ((torch.tensor([5, 2**64 - 1], dtype=torch.uint64), f"id {2**64 - 1} "),
                       (np.array([5, 2**64 - 2], dtype=np.uint64), f"id {2**64 - 2} "),
                       (torch.tensor([5, -2]), "id -2 ")):
        for call in (e, e.prefetch):
            with pytest.raises(hkvd.ReservedKey) as err:
                call(ids)
            assert err.value.message.startswith(named + "(0x")
    assert e.step == 0 and e(torch.tensor([5], dtype=torch.uint64)).shape == (1, 2)
    c.close()


def test_a_device_or_hyperparameter_torch_cannot_use_is_refused_when_made(daemon, capsys):
    """A tester's Embedding(device="meta") was made and failed at the
    forward with torch's "Cannot copy out of meta tensor"; device="cuda"
    without a GPU with torch's "Found no NVIDIA driver"; lr="0.1" was
    taken as 0.1. They are refused when the module (or cache) is made,
    by hkvd, before any buffer or transport line; numbers of numpy or
    torch are still taken."""
    from hkvd.torch import Embedding, EmbeddingBag

    c = daemon.client()
    c.create_table("dev", dim=2, capacity=64, optimizer="sgd")
    devices = ["meta", "xyz"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"])
    for device in devices:
        for make in (Embedding, EmbeddingBag, EmbeddingCache):
            with pytest.raises(ValueError, match=f"device '?{device}"):
                make(c, "dev", device=device)
    for kw, name in (({"lr": "0.1"}, "lr"), ({"lr": True}, "lr"), ({"eps": b"1"}, "eps"),
                     ({"weight_decay": "0"}, "weight_decay"), ({"betas": (0.9, "0.99")}, r"betas\[1\]")):
        with pytest.raises(TypeError, match=f"^{name} must be a number"):
            Embedding(c, "dev", **kw)
    assert capsys.readouterr().err == "", "nothing was made"
    e = Embedding(c, "dev", lr=np.float32(0.5), eps=torch.tensor(1e-6), weight_decay=0, device="cpu", verbose=False)
    assert e.lr == 0.5 and e.weight_decay == 0.0
    e(torch.tensor([1])).sum().backward()
    e.flush()
    assert c.find("dev", [1])[0][0].tolist() == [-0.5, -0.5]
    e.lr = "0.5"  # set later: refused at the backward, the step not counted
    with pytest.raises(TypeError, match="^lr must be a number"):
        e(torch.tensor([1])).sum().backward()
    e.lr = 0.5
    e(torch.tensor([1])).sum().backward()
    e.flush()
    assert e.step == 2 and c.find("dev", [1])[0][0].tolist() == [-1.0, -1.0]
    c.close()


@pytest.mark.parametrize("dedupe", ["table", "module"])
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_table_made_again_by_the_modules_own_client_is_named(daemon, transport, dedupe):
    """A tester dropped and created a module's table again through the
    module's own client with rows as wide (adagrad dim 4, then sgd dim 8:
    8 floats a row). The daemon refuses that only on other connections,
    so the forward returned the first 4 columns of each new row as the
    old table's values, and the backward then failed on a gradient's
    shape. Now the module says the table was made again (the new dim
    named), and so does every forward, step and prefetch after it; with
    the same spec too; and its cache refuses the same. The new table's
    rows are left as they were."""
    from hkvd.torch import Embedding

    c = daemon.client()
    kw = dict(lr=0.1, verbose=False, device="cpu", transport=transport, dedupe=dedupe)
    ids = torch.tensor([1, 2])
    for new_dim, new_opt, err in [(8, "sgd", hkvd.WrongDim), (4, "adagrad", hkvd.UnknownTable)]:
        name = f"own_{new_dim}"
        c.create_table(name, dim=4, capacity=1024, optimizer="adagrad")
        e = Embedding(c, name, **kw)
        e(ids).sum().backward()
        e.prefetch(ids)
        late = e(ids)  # its backward comes after the table is made again
        c.drop_table(name)
        c.create_table(name, dim=new_dim, capacity=1024, optimizer=new_opt)
        row_dim = c.dim(name)
        c.insert_or_assign(name, [1, 2], np.full((2, row_dim), 7.0, np.float32))
        with pytest.raises(err):
            late.sum().backward()
        for _ in range(2):
            with pytest.raises(err):
                e(ids)
            with torch.no_grad(), pytest.raises(err):
                e(ids)
            with pytest.raises(err):
                e.prefetch(ids)
        with pytest.raises(hkvd.UnknownTable):
            e.cache.lookup(ids)
        assert e.step == 1
        values, found = c.find(name, [1, 2])
        assert found.all() and (values == 7.0).all()
        # A module made for the new table reads its rows.
        assert torch.equal(Embedding(c, name, **kw)(ids), torch.full((2, new_dim), 7.0))
    c.close()


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_an_embedding_cache_of_a_table_its_client_made_again_refuses(daemon, transport):
    """The same for an EmbeddingCache: its client dropped and created the
    table again with rows as wide, and the cache's next lookups read the
    new rows with the old dims."""
    c = daemon.client()
    c.create_table("ec_own", dim=4, capacity=1024, optimizer="adagrad")
    cache = EmbeddingCache(c, "ec_own", device="cpu", transport=transport, verbose=False)
    cache.lookup(torch.tensor([1]))
    c.drop_table("ec_own")
    c.create_table("ec_own", dim=8, capacity=1024, optimizer="sgd")
    for _ in range(2):
        with pytest.raises(hkvd.UnknownTable):
            cache.lookup(torch.tensor([1]))
    assert EmbeddingCache(c, "ec_own", device="cpu", transport=transport, verbose=False).dim == 8
    c.close()


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_embedding_cache_apply_gradients_refuses_an_optimizer_table(daemon, transport, opt):
    """EmbeddingCache.apply_gradients is accum_or_assign of -lr * grads. On
    a tester's adagrad table it did plain SGD, silently, the accumulators
    untouched (and an absent id would be inserted as -lr * grad). On a
    table with an optimizer it is refused, pointing to optimizer_step,
    which runs the table's optimizer; nothing is written."""
    c = daemon.client()
    c.create_table("ag", dim=4, capacity=1024, optimizer=opt)
    cache = EmbeddingCache(c, "ag", device="cpu", transport=transport, verbose=False)
    ids = torch.tensor([1, 2, 2])
    before = cache.lookup(ids)
    with pytest.raises(ValueError, match="optimizer_step"):
        cache.apply_gradients(ids, torch.ones(3, 4), 0.1)
    with pytest.raises(ValueError, match="optimizer_step"):
        cache.apply_gradients(torch.tensor([9]), torch.ones(1, 4), 0.1)
    assert torch.equal(cache.lookup(ids), before)
    assert not c.contains("ag", [9]).any()
    assert cache.optimizer_step(torch.tensor([1, 2]), torch.ones(2, 4), lr=0.1) == 0
    c.close()


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_batches_past_max_batch_are_prefetched_with_dedupe_table(daemon, transport):
    """With dedupe "table" a batch of more positions than max_batch takes
    the module's deduplication at the forward, and prefetch() dropped it
    silently: a tester's DLRM batches (4096 x 26 ids, max_batch 65536)
    were never prefetched. Now its lookup is sent as the module's
    deduplication sends it (patched after the step), so the forwards use
    it, and rows and outputs are bit-identical to an unprefetched run
    (here max_batch 16, 32 positions of at most 12 distinct ids, Adam)."""
    from hkvd.torch import Embedding, Prefetcher

    c = daemon.client()
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 12, (8, 4), generator=g) for _ in range(6)]
    init = lambda i: (i % 7).float()[:, None].expand(-1, 4) / 7  # noqa: E731
    runs = {}
    for prefetched in (False, True):
        name = f"big_{prefetched}"
        c.create_table(name, dim=4, capacity=1024, optimizer="adam")
        e = Embedding(c, name, lr=0.05, init=init, transport=transport, verbose=False, max_batch=16)
        outs = []
        for ids in (Prefetcher(batches, e) if prefetched else batches):
            out = e(ids)
            outs.append(out.detach().clone())
            (out * torch.arange(4.0)).pow(2).sum().backward()
        e.flush()
        runs[prefetched] = (outs, c.find(name, np.arange(12, dtype=np.uint64))[0], e.prefetch_hits)
    assert runs[True][2] == len(batches) and runs[False][2] == 0
    assert all(torch.equal(a, b) for a, b in zip(runs[True][0], runs[False][0]))
    assert np.array_equal(runs[True][1].view(np.uint32), runs[False][1].view(np.uint32))
    c.close()


@pytest.mark.parametrize("reader", ["forward", "flush"])
def test_a_step_without_an_answer_is_not_called_refused(tmp_path, reader):
    """The daemon killed with a step in flight (its answer never read): a
    tester's next request said the step "was refused and not applied".
    No answer came, so whether it was applied is unknown, and the error
    (ConnectionLost) says so; "refused" stays for the daemon's refusals."""
    from conftest import Daemon
    from test_client import stop

    from hkvd.torch import Embedding

    d = Daemon(tmp_path)
    try:
        c = hkvd.Client(d.socket, timeout=30)
        c.create_table("k", dim=4, capacity=1024, optimizer="adam")
        e = Embedding(c, "k", lr=0.1, verbose=False, device="cpu", transport="shm")
        out = e(torch.tensor([1, 2]))
        stop(d.proc)  # the step is sent, not read
        out.sum().backward()
        d.proc.kill()
        d.proc.wait(timeout=30)
        with pytest.raises(hkvd.ConnectionLost) as err:
            e(torch.tensor([1, 2])) if reader == "forward" else e.flush()
        assert "refused" not in err.value.message and "unknown" in err.value.message
        c.close()
    finally:
        d.proc.kill()
        d.proc.wait(timeout=30)


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_closed_client_raises_connection_lost(daemon, transport):
    """A module, cache or Client used after client.close() raised the
    socket's OSError "Bad file descriptor" (a tester's). It raises
    ConnectionLost, the client's error for a connection that is gone."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("cl", dim=4, capacity=1024, optimizer="adam")
    e = Embedding(c, "cl", lr=0.1, verbose=False, device="cpu", transport=transport)
    cache = EmbeddingCache(c, "cl", device="cpu", transport=transport, verbose=False)
    out = e(torch.tensor([1, 2]))
    c.close()
    for call in (lambda: out.sum().backward(), lambda: e(torch.tensor([1])), lambda: cache.lookup([1]),
                 lambda: c.find("cl", [1]), lambda: c.ping()):
        with pytest.raises(hkvd.ConnectionLost):
            call()
    c.close()  # a second close is no error


def test_an_init_returning_no_rows_is_named(daemon):
    """An init returning None raised torch's "must be real number, not
    NoneType" (a tester's); it is named, with the shape wanted, as a
    wrong shape is."""
    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("in", dim=4, capacity=1024, optimizer="sgd")
    for dedupe in ("table", "module"):
        for bad in (lambda ids: None, lambda ids: "rows"):
            e = Embedding(c, "in", lr=0.1, verbose=False, device="cpu", dedupe=dedupe, init=bad)
            with pytest.raises(TypeError, match=r"init\(ids\) returned"):
                e(torch.tensor([5]))
    cache = EmbeddingCache(c, "in", init=lambda n, d: None, device="cpu", verbose=False)
    with pytest.raises(TypeError, match=r"init\(1, 4\) returned None"):
        cache.lookup([6])
    assert not c.contains("in", [5, 6]).any()
    c.close()


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_step_a_stalled_cluster_node_may_run_is_not_called_refused(daemon, redis_cluster, transport):
    """A tester stopped (SIGSTOP) a master of a write-through table's
    cluster mid-training: the step failed with the daemon's "the write may
    have reached some of the cluster's nodes", the module said it "was
    refused and not applied", yet the stopped node ran it when it resumed
    and every row had it. The module now says its fate is unknown (it is
    not counted, as a step whose answer never came)."""
    import signal

    from hkvd.torch import Embedding

    c = daemon.client()
    c.create_table("stalled", dim=2, capacity=1024, optimizer="sgd",
                   backing=redis_cluster.seeds(), backing_mode="write-through")
    emb = Embedding(c, "stalled", lr=0.125, transport=transport, verbose=False)
    ids = torch.arange(1, 65)
    emb(ids).sum().backward()
    emb.flush()
    assert emb.step == 1
    for p in redis_cluster.procs:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        with pytest.raises(hkvd.BackingUnavailable) as e:
            emb(ids).sum().backward()
            emb.flush()
    finally:
        for p in redis_cluster.procs:
            os.kill(p.pid, signal.SIGCONT)
    # Over shm the module reads the step's answer later and says whose it
    # is; over the socket the daemon's own words come at once.
    said = "whether (and to which rows) it was applied is unknown" if transport == "shm" else "may have reached"
    assert said in str(e.value), str(e.value)
    assert "refused and not applied" not in str(e.value), str(e.value)
    assert emb.step == 1, "a step of unknown fate is not counted"
    c.close()


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("dedupe", ["table", "module"])
@pytest.mark.parametrize("shared", [True, False])
def test_threads_each_with_a_module_of_one_table_step_every_row_exactly(daemon, shared, dedupe, prefetch):
    # A tester's six threads, each with its own module of one table over
    # one shared client (shm), stepped rows of their next batch, silently:
    # a thread reading the deferred answers settled another thread's step,
    # whose own thread then took it for answered and wrote its next keys
    # into the buffers the daemon had yet to read the step from (rows at
    # -0.9 and -1.1 where -1.0 was due). With prefetch, modules of one
    # table in several threads (shared client or not) took each other's
    # pending lookups from their lists (IndexError). Every row must get
    # exactly its steps.
    import threading

    c = hkvd.Client(daemon.socket, timeout=30)
    c.create_table("th", dim=4, capacity=1 << 14, optimizer="sgd")
    threads, steps, errors = 6, 100, []

    def train(i):
        try:
            cl = c if shared else hkvd.Client(daemon.socket, timeout=30)
            m = hkvd.torch.Embedding(cl, "th", lr=0.1, device="cpu", verbose=False, transport="shm", dedupe=dedupe)
            for s in range(steps):
                if prefetch:
                    m.prefetch(torch.tensor([i * 100 + (s + 1) % 5]))
                m(torch.tensor([i * 100 + s % 5])).sum().backward()
            m.flush()
            assert m.step == steps and m.missing == 0
        except Exception as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(repr(e))

    ts = [threading.Thread(target=train, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts) and errors == []
    keys = np.array([i * 100 + k for i in range(threads) for k in range(5)], np.uint64)
    values, found = c.find("th", keys)
    assert found.all()
    assert np.round(-values[:, 0] / 0.1).astype(int).tolist() == [steps // 5] * keys.size


def test_a_wrong_extra_state_init_or_hyperparameter_is_refused_at_once(daemon):
    # A tester's load_state_dict took {"step": -3} (and 2**64, 1.7): the
    # next backward raised and still moved the count; "garbage" gave
    # "string indices must be integers"; init=5 was taken until a forward;
    # apply_gradients(lr="0.1") raised struct.error.
    c = daemon.client()
    c.create_table("x", dim=4, capacity=1 << 10, optimizer="sgd")
    m = hkvd.torch.Embedding(c, "x", device="cpu", verbose=False)
    for bad, kind in [({"step": -3}, ValueError), ({"step": 2 ** 64}, ValueError), ({"step": 1.7}, TypeError),
                      ("garbage", TypeError), ({}, TypeError)]:
        with pytest.raises(kind):
            m.load_state_dict({"_extra_state": bad})
        assert m.step == 0
    m.load_state_dict({"_extra_state": {"step": 7}})
    m(torch.tensor([1])).sum().backward()
    m.flush()
    assert m.step == 8
    with pytest.raises(TypeError, match="init"):
        hkvd.torch.Embedding(c, "x", init=5, device="cpu", verbose=False)
    with pytest.raises(TypeError, match="init"):
        EmbeddingCache(c, "x", init=5, device="cpu", verbose=False)
    for name in ("lr", "eps", "beta1", "beta2", "weight_decay"):
        hyper = {"lr": 0.1, name: "0.1"}
        with pytest.raises(TypeError, match=name):
            c.apply_gradients("x", [1], np.ones((1, 4), np.float32), **hyper)


def test_wrong_rows_timeouts_read_only_outputs_and_wide_keys_are_refused_clearly(daemon):
    # A tester's findings: rows of the wrong width gave torch's "shape
    # '[-1, 4]' is invalid"; Client(timeout=0) raised BlockingIOError at
    # the first call; a read-only shm array was written as a find's output;
    # a key of 2**64 was "not object".
    c = daemon.client()
    c.create_table("w", dim=4, capacity=1 << 10)
    cache = EmbeddingCache(c, "w", device="cpu", verbose=False, transport="shm")
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        cache.apply_gradients(torch.tensor([1, 2]), torch.ones(10), lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        cache.write_back(torch.tensor([1, 2]), torch.ones((2, 5)))
    for bad, kind in [(0, ValueError), (-1, ValueError), (float("nan"), ValueError), ("1", TypeError)]:
        with pytest.raises(kind, match="timeout"):
            hkvd.Client(daemon.socket, timeout=bad)
    keys = hkvd.shm_array((2,), np.uint64)
    keys[:] = [1, 2]
    found, values = hkvd.shm_array((2,), np.uint8), hkvd.shm_array((2, 4), np.float32)
    values[:] = 7.0
    values.setflags(write=False)
    with pytest.raises(ValueError, match="values is read-only"):
        c.find_region("w", keys, values, found)
    assert (values == 7.0).all()
    with pytest.raises(ValueError, match="out of range"):
        c.find("w", [2 ** 64])
