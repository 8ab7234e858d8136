"""Rows of an hkvd table as torch tensors, over the fastest transport the
daemon and the tensors allow.

Needs torch; importing this module without it raises ImportError.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional

import numpy as np
import torch

from . import Client, HkvdError, region
from .cuda import CudaError, CudaIpcUnavailable
from .shm import shm_array

TRANSPORTS = ("cuda-ipc", "shm", "socket")
_NAMES = {"cuda-ipc": "CUDA IPC", "shm": "shared memory", "socket": "the socket"}


def _align(n: int, to: int = 256) -> int:
    return -(-n // to) * to


class EmbeddingCache:
    """Rows of one hkvd table as torch tensors on ``device``.

    ``lookup(ids)`` returns float32 rows of shape ``ids.shape + (dim,)`` on
    ``device``: stored rows for known ids and, for unknown ids, rows from
    ``init(n, dim)`` (zeros by default), which are inserted so the next
    lookup finds them (find_or_insert). ``apply_gradients(ids, grads, lr)``
    adds ``-lr * grads`` to the rows (accum_or_assign; the gradients of
    repeated ids are summed first). ``write_back(ids, rows)`` stores rows
    (insert_or_assign). Batches of more than ``max_batch`` distinct ids are
    split.

    ``transport`` picks how the arrays reach the daemon:

    - ``cuda-ipc``: preallocated device buffers for ``max_batch`` keys
      (keys, values, found: one allocation) registered once with CUDA IPC;
      ids are copied into them on the GPU and the daemon reads and writes
      them in place, ordered with torch's current stream through
      interprocess events (``events=False``: the stream is synchronized
      instead). Needs ``device`` to be a GPU the daemon serves.
    - ``shm``: the same buffers in ``hkvd.shm_array`` memory.
    - ``socket``: arrays sent and received through the socket.
    - ``auto`` (default): the first of these that works, in that order
      (``cuda-ipc`` only for a CUDA ``device``).

    ``self.transport`` says which one is used, and one line naming it (and
    why a faster one was not) is printed to stderr unless ``verbose`` is
    False.
    """

    def __init__(self, client: Client, table: str, init: Optional[Callable] = None, *, device=None,
                 max_batch: int = 1 << 16, transport: str = "auto", events: bool = True, verbose: bool = True):
        if transport not in ("auto",) + TRANSPORTS:
            raise ValueError(f"transport must be auto, {', '.join(TRANSPORTS)}; not {transport!r}")
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.client = client
        self.table = table
        self.dim = client.dim(table)
        self.init = init
        self.max_batch = max_batch
        self.events = events
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if transport == "auto":
            order = list(TRANSPORTS) if self.device.type == "cuda" else ["shm", "socket"]
        else:
            order = [transport]
        why: List[str] = []
        for t in order:
            try:
                getattr(self, "_setup_" + t.replace("-", "_"))()
            except (CudaIpcUnavailable, CudaError, HkvdError, OSError, ValueError) as e:
                if transport != "auto":
                    raise
                why.append(f"{_NAMES[t]} unavailable: {e}")
                continue
            self.transport = t
            break
        where = f" (GPU {self.device.index})" if self.transport == "cuda-ipc" else ""
        self.message = f"hkvd.torch: table {table} over {_NAMES[self.transport]}{where}"
        if why:
            self.message += "; " + "; ".join(why)
        if verbose:
            print(self.message, file=sys.stderr)

    # ---- transports ---------------------------------------------------
    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type != "cuda":
            raise ValueError(f"cuda-ipc needs a CUDA device, not {self.device}")
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _setup_cuda_ipc(self) -> None:
        m, d = self.max_batch, self.dim
        kb, vb = _align(8 * m), _align(4 * m * d)
        # One allocation for the three buffers: one region, one IPC open in
        # the daemon (the first open in a process costs ~100 ms).
        buf = self._device_buffer(kb + vb + _align(m))
        self._buf = buf
        self._keys = buf[:8 * m].view(torch.int64)
        self._values = buf[kb:kb + 4 * m * d].view(torch.float32).view(m, d)
        self._found = buf[kb + vb:kb + vb + m]
        self._refs = [self.client.region_ref(x) for x in (self._keys, self._values, self._found)]
        if self.events:
            try:
                region._own_events(self.client, self._refs[0].device)
            except (CudaIpcUnavailable, CudaError) as e:
                print(f"hkvd.torch: interprocess events unavailable ({e}); synchronizing the stream instead",
                      file=sys.stderr)
                self.events = False

    def _setup_shm(self) -> None:
        m, d = self.max_batch, self.dim
        self._keys_np = shm_array((m,), np.int64)
        self._values_np = shm_array((m, d), np.float32)
        self._found_np = shm_array((m,), np.uint8)
        self._refs = [self.client.region_ref(x) for x in (self._keys_np, self._values_np, self._found_np)]

    def _setup_socket(self) -> None:
        self._refs = []

    # ---- helpers ------------------------------------------------------
    def _sync_args(self):
        if self.events:
            return {"wait": True, "done": True}
        return {"wait": False, "done": False}

    def _ids(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            t = ids
        else:
            a = np.asarray(ids)
            t = torch.from_numpy(np.ascontiguousarray(a.view(np.int64) if a.dtype == np.uint64 else a.astype(np.int64)))
        if t.dtype != torch.int64:
            t = t.to(torch.int64)
        return t.reshape(-1)

    def _init_rows(self, n: int) -> torch.Tensor:
        rows = torch.as_tensor(self.init(n, self.dim), dtype=torch.float32)
        if rows.shape != (n, self.dim):
            raise ValueError(f"init({n}, {self.dim}) returned shape {tuple(rows.shape)}")
        return rows.to(self.device)

    def _op(self, op: int, keys: torch.Tensor, rows: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> None:
        """One chunk of at most max_batch keys: ``rows`` sent (values or
        deltas; None: zeros), the stored rows written to ``out`` for
        find_or_insert."""
        m = keys.numel()
        c = self.client
        if self.transport == "cuda-ipc":
            self._keys[:m].copy_(keys, non_blocking=True)
            if rows is None:
                self._values[:m].zero_()
            else:
                self._values[:m].copy_(rows, non_blocking=True)
            k, v = self._refs[0].head(m), self._refs[1].head(m)
            region.call(c, op, self.table, [k, v], **self._sync_args())
            if out is not None:
                out.copy_(self._values[:m])
        elif self.transport == "shm":
            np.copyto(self._keys_np[:m], keys.cpu().numpy())
            if rows is None:
                self._values_np[:m] = 0.0
            else:
                np.copyto(self._values_np[:m], rows.detach().cpu().numpy())
            region.call(c, op, self.table, [self._refs[0].head(m), self._refs[1].head(m)])
            if out is not None:
                out.copy_(torch.from_numpy(self._values_np[:m]))
        else:
            k = keys.cpu().numpy().view(np.uint64)
            if rows is None:
                v = np.zeros((m, self.dim), dtype=np.float32)
            else:
                v = np.ascontiguousarray(rows.detach().cpu().numpy(), dtype=np.float32)
            if op == region.OP_FIND_OR_INSERT:
                out.copy_(torch.from_numpy(c.find_or_insert(self.table, k, v)))
            elif op == region.OP_ACCUM_OR_ASSIGN:
                c.accum_or_assign(self.table, k, v)
            else:
                c.insert_or_assign(self.table, k, v)

    def _chunks(self, op: int, keys: torch.Tensor, rows: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> None:
        for s in range(0, keys.numel(), self.max_batch):
            e = min(s + self.max_batch, keys.numel())
            self._op(op, keys[s:e], None if rows is None else rows[s:e], None if out is None else out[s:e])

    # ---- API ----------------------------------------------------------
    def lookup(self, ids) -> torch.Tensor:
        """Rows of ``ids`` (any shape of int64 ids): shape ``ids.shape + (dim,)``."""
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else np.shape(ids)
        flat = self._ids(ids)
        if flat.numel() == 0:
            return torch.zeros(shape + (self.dim,), dtype=torch.float32, device=self.device)
        uniq, inv = torch.unique(flat, return_inverse=True)
        uniq = uniq.to(self.device)
        rows = None if self.init is None else self._init_rows(uniq.numel())  # None: zeros
        out = torch.empty((uniq.numel(), self.dim), dtype=torch.float32, device=self.device)
        self._chunks(region.OP_FIND_OR_INSERT, uniq, rows, out)
        return out[inv.to(self.device)].reshape(shape + (self.dim,))

    def apply_gradients(self, ids, grads: torch.Tensor, lr: float) -> None:
        """Adds ``-lr * grads`` to the rows of ``ids`` (``grads``: shape
        ``ids.shape + (dim,)`` or ``(n, dim)``); repeated ids get the sum of
        their gradients."""
        flat = self._ids(ids)
        if flat.numel() == 0:
            return
        g = grads.detach().reshape(-1, self.dim).to(device=self.device, dtype=torch.float32)
        if g.shape[0] != flat.numel():
            raise ValueError(f"{flat.numel()} ids but {g.shape[0]} gradient rows")
        uniq, inv = torch.unique(flat.to(self.device), return_inverse=True)
        summed = torch.zeros((uniq.numel(), self.dim), dtype=torch.float32, device=self.device)
        summed.index_add_(0, inv, g)
        summed.mul_(-float(lr))
        self._chunks(region.OP_ACCUM_OR_ASSIGN, uniq, summed, None)

    def write_back(self, ids, rows: torch.Tensor) -> None:
        """Stores ``rows`` for ``ids`` (insert_or_assign)."""
        flat = self._ids(ids).to(self.device)
        r = rows.detach().reshape(-1, self.dim).to(device=self.device, dtype=torch.float32)
        if r.shape[0] != flat.numel():
            raise ValueError(f"{flat.numel()} ids but {r.shape[0]} rows")
        self._chunks(region.OP_INSERT_OR_ASSIGN, flat, r, None)
