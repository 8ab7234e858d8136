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
