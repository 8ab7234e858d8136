"""EmbeddingCache on CPU tensors (skipped without torch): it falls back to
shared memory, then the socket, says which, and every transport gives the
same rows; apply_gradients sums repeated ids; batches are split."""

import numpy as np
import pytest

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
