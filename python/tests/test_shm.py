"""Registered regions from Python: shm arrays registered once, find and
insert_or_assign through them equal the socket's, bad memfds refused."""

import os

import numpy as np
import pytest

import hkvd
from hkvd import shm


def test_find_and_insert_through_shm_arrays_match_the_socket(daemon):
    with daemon.client() as c:
        c.create_table("t", 8, 4096)
        keys = hkvd.shm_array((100,), np.uint64)
        keys[:] = np.arange(1, 101, dtype=np.uint64)
        values = hkvd.shm_array((100, 8), np.float32)
        values[:] = np.arange(800, dtype=np.float32).reshape(100, 8)
        s = c.insert_or_assign_shm("t", keys, values)
        assert s.inserted == 100
        probe = hkvd.shm_array((150,), np.uint64)
        probe[:] = np.arange(51, 201, dtype=np.uint64)
        out = hkvd.shm_array((150, 8), np.float32)
        out[:] = 7.5
        found = hkvd.shm_array((150,), np.uint8)
        assert c.find_shm("t", probe, out, found) == 50
        want, wfound = c.find("t", np.arange(51, 201, dtype=np.uint64))
        assert np.array_equal(out, want)
        assert np.array_equal(found.astype(bool), wfound)
        # A view of a shm array is named by its offset; the memfd is registered once.
        assert c.find_shm("t", probe[100:], out[100:]) == 0
        assert not out[100:].any()
        st = c.stats()["regions"]
        assert st["regions"] == 6  # keys, values, probe, out, found, the scratch found array
        assert st["bytes"] > 0


def test_bad_memfds_are_refused(daemon):
    with daemon.client() as c:
        fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        with pytest.raises(hkvd.BadRequest, match="F_SEAL_SHRINK"):
            shm.register_memfd(c, fd, 4096)
        r, w = os.pipe()
        with pytest.raises(hkvd.BadRequest, match="not a memfd"):
            shm.register_memfd(c, r, 4096)
        for x in (fd, r, w):
            os.close(x)
        with pytest.raises(ValueError, match="shm_array"):
            c.find_shm("t", np.zeros(3, np.uint64), np.zeros((3, 8), np.float32))
        c.ping()


def _memfds() -> int:
    """This process's open memfds of hkvd.shm."""
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += "hkvd-region" in os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass  # the listing's own fd
    return n


def test_dropped_shm_arrays_are_released(daemon):
    # A loop that makes temporary shm arrays keeps neither their memfds
    # (client) nor their regions (daemon): each is released once its last
    # view is gone, the region unregistered with the client's next request.
    with daemon.client() as c:
        c.create_table("t", 4, 1024)
        keys = hkvd.shm_array((8,), np.uint64)
        keys[:] = np.arange(1, 9, dtype=np.uint64)
        kept = hkvd.shm_array((8, 4), np.float32)
        c.insert_or_assign_shm("t", keys, kept)
        assert c.find_shm("t", keys, kept) == 8  # (makes the client's scratch found array)
        fds, base = _memfds(), c.stats()["regions"]["regions"]
        for i in range(300):
            out = hkvd.shm_array((8, 4), np.float32)
            view = out[2:]  # a view keeps the memory: nothing released yet
            del out
            assert c.find_shm("t", keys[2:], view) == 6
            del view
        assert _memfds() == fds
        # (The last array's region is unregistered with the stats request.)
        assert c.stats()["regions"]["regions"] == base
        # The arrays still held are untouched: their regions stay registered.
        kept[:] = 2.0
        assert c.insert_or_assign_shm("t", keys, kept).updated == 8
        got, _ = c.find("t", keys)
        assert (got == 2.0).all()
    # A client closed with releases queued, and an array dropped after its
    # client closed: nothing is sent, nothing raised.
    with daemon.client() as c:
        a = hkvd.shm_array((4,), np.uint64)
        a[:] = [1, 2, 3, 4]
        assert c.contains_region("t", a) == 4
    del a


def test_threads_making_and_dropping_shm_arrays_each_get_their_own_rows(daemon):
    # Python unmaps a dropped array's memory before its finalizer runs, so
    # another thread's new array may be given the same addresses first:
    # each client must still name its own memfd, and read its own rows.
    import threading
    import time

    with daemon.client() as c:
        c.create_table("t", 8, 4096)
        keys = np.arange(1, 257, dtype=np.uint64)
        c.insert_or_assign("t", keys, np.repeat(keys.astype(np.float32)[:, None], 8, 1))
    errors = []
    stop = time.monotonic() + 4

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with daemon.client() as c:
            for _ in range(20000):
                if time.monotonic() > stop:
                    break
                k = hkvd.shm_array((64,), np.uint64)
                v = hkvd.shm_array((64, 8), np.float32)
                k[:] = rng.integers(1, 257, 64, dtype=np.uint64)
                try:
                    assert c.find_region("t", k, v) == 64
                    assert (v == k.astype(np.float32)[:, None]).all(), "another array's rows"
                except Exception as e:  # noqa: BLE001 (reported below)
                    errors.append(f"{type(e).__name__}: {e}")
                del k, v

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} failures, e.g. {sorted(set(errors))[:3]}"
    assert not shm._MEMFDS or all(not m.released for m in shm._MEMFDS.values())


def test_negative_shapes_are_refused():
    for shape in [(-1,), (-1, 4), -5]:
        with pytest.raises(ValueError, match="negative dimensions"):
            hkvd.shm_array(shape, np.float32)
    assert hkvd.shm_array(3).shape == (3,)
    assert hkvd.shm_array((0, 4)).shape == (0, 4)
