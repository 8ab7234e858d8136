"""Registered regions over shared memory (``proto/PROTOCOL.md``,
"Registered regions"), with no dependency beyond numpy and the standard
library.

``shm_array(shape, dtype)`` returns a numpy array whose memory is a sealed
memfd (``os.memfd_create``, ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``,
``mmap``). A :class:`hkvd.Client` registers the memfd on its connection the
first time one of its arrays (or a contiguous view of one) is named in a
request (``register_memfd``, the fd passed with ``SCM_RIGHTS``), and keeps
the region id for later requests; the daemon then reads keys and writes
rows straight into that memory, and the socket carries only the request
and a small answer.

The daemon reads and writes the arrays only while a call runs: read the
outputs after it returned; do not change the inputs of a request still in
flight.
"""

from __future__ import annotations

import array
import fcntl
import itertools
import mmap
import os
import socket as _socket
import struct
import threading
import weakref
from typing import Dict, Optional, Tuple

import numpy as np

OP_REGISTER_MEMFD = 0x40
OP_UNREGISTER = 0x41
F_REGION = 0x0010
F_SCORES = 0x0002
F_OUTCOMES = 0x0004
_REF = struct.Struct("<IQQ")
_PAGE = mmap.PAGESIZE


class _Memfd:
    """One sealed memfd, mapped at ``base`` (the mapping itself is held by
    the arrays over it, not here); ``serial`` names it for the process's
    life (an address is mapped again once its mapping is gone)."""

    _serials = itertools.count(1)

    def __init__(self, fd: int, size: int, base: int):
        self.fd, self.size, self.base = fd, size, base
        self.serial = next(self._serials)
        self.released = False


# Every live shm array's memfd by the address of its mapping. When the
# last array (or view) over a mapping is gone its fd is closed and its
# entry removed (`_release`), and every client that registered it
# unregisters it with its next request. Python unmaps a mapping before its
# finalizer runs, with the GIL released, so another thread may be given
# the same addresses first: a new mapping releases the entries it overlaps
# (`shm_array`), and clients key their regions by serial, not address.
_MEMFDS: Dict[int, _Memfd] = {}
_LOCK = threading.RLock()
# The clients that registered shm arrays (weakly: a client is not kept
# alive for its regions).
_CLIENTS: "weakref.WeakSet" = weakref.WeakSet()


def shm_array(shape, dtype=np.float32) -> np.ndarray:
    """A zeroed numpy array of ``shape`` and ``dtype`` in a new sealed memfd.
    Its memory is released when the array and every view of it are gone:
    the memfd is closed, and a client that registered it unregisters it
    with its next request."""
    dtype = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(int(d) < 0 for d in dims):
        raise ValueError(f"shm_array: negative dimensions are not allowed (shape {shape})")
    count = int(np.prod(dims, dtype=np.int64))
    size = max(_PAGE, -(-(count * dtype.itemsize) // _PAGE) * _PAGE)
    fd = os.memfd_create("hkvd-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    base = np.frombuffer(mm, dtype=np.uint8).__array_interface__["data"][0]
    m = _Memfd(fd, size, base)
    with _LOCK:
        # Entries these addresses overlap belong to mappings already gone
        # whose finalizers have not run yet.
        for old in [o for o in _MEMFDS.values() if o.base < base + size and base < o.base + o.size]:
            _release(old)
        _MEMFDS[base] = m
    weakref.finalize(mm, _release, m)
    return np.frombuffer(mm, dtype=dtype, count=count).reshape(dims)


def _release(m: _Memfd) -> None:
    """``m``'s mapping is gone: its fd is closed, and its region ids are
    queued on the clients that registered it (``Client._unneeded``). Once."""
    with _LOCK:
        if m.released:
            return
        m.released = True
        if _MEMFDS.get(m.base) is m:
            del _MEMFDS[m.base]
        os.close(m.fd)
        for c in list(_CLIENTS):
            rid = c.__dict__.get("_regions", {}).pop(m.serial, None)
            if rid is not None:
                c._unneeded.append(rid)


def _memfd_of(a: np.ndarray) -> Tuple[_Memfd, int]:
    """The memfd holding ``a`` and the byte offset of ``a`` in it."""
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        raise ValueError("region arrays must be C-contiguous views of an hkvd.shm_array")
    addr = a.__array_interface__["data"][0]
    for m in list(_MEMFDS.values()):
        if m.base <= addr and addr + a.nbytes <= m.base + m.size:
            return m, addr - m.base
    raise ValueError("this array is not in an hkvd.shm_array; make it with hkvd.shm_array(shape, dtype)")


def register_memfd(client, fd: int, nbytes: int) -> int:
    """Sends ``register_memfd`` with ``fd`` (any fd: the daemon checks it) and
    returns the region id."""
    client._here()  # before the lock, which a parent's thread may hold in a forked child
    with client._io:  # the id, the frame and its pending entry together
        rid = client._next
        client._next += 1
        frame = client_header(OP_REGISTER_MEMFD, 0, rid, 8) + struct.pack("<Q", nbytes)
        anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [fd]))]
        client._pending[rid] = _raw_pending(client, rid)
        try:
            client._sendmsg([frame], anc)
        except BaseException:
            client._pending.pop(rid, None)
            raise
    body = client.result(rid)
    region, _ = struct.unpack("<IQ", body)
    return region


def unregister(client, region: int) -> None:
    """Unregisters a region id of this client."""
    from . import _uint

    client._call(OP_UNREGISTER, F_REGION, [struct.pack("<I", _uint(region, 32, "region"))])


def client_header(op: int, flags: int, rid: int, length: int) -> bytes:
    from . import HEADER, MAGIC, VERSION

    return HEADER.pack(MAGIC, VERSION, op, flags, rid, length)


def _raw_pending(client, rid):
    from . import _Pending

    return _Pending(OP_REGISTER_MEMFD, 0, 0, F_REGION)


def ref(client, a: np.ndarray) -> bytes:
    """The 20-byte reference to ``a``, registering its memfd on first use."""
    from . import region

    return _REF.pack(*region.ref(client, a).wire())


def scratch_found(client, n: int) -> np.ndarray:
    """A client's scratch ``found`` array of ``n`` bytes in shm memory."""
    scratch = client.__dict__.get("_found")
    if scratch is None or scratch.size < n:
        scratch = shm_array((max(n, 1),), np.uint8)
        client._found = scratch
    return scratch[:n]


def find(client, table: str, keys: np.ndarray, values: np.ndarray, found: Optional[np.ndarray] = None) -> int:
    """find with ``keys`` (n uint64), ``values`` (n × dim float32, written)
    and ``found`` (n uint8 or bool, written) in shm arrays; returns the hits."""
    return client.find_region(table, keys, values, found)


def insert_or_assign(client, table: str, keys: np.ndarray, values: np.ndarray, scores: Optional[np.ndarray] = None):
    """insert_or_assign with ``keys``, ``values`` (and ``scores``) in shm
    arrays; returns the summary."""
    return client.insert_or_assign_region(table, keys, values, scores)
