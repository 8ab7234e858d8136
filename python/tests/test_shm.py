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
