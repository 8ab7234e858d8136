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
