"""Rows of an hkvd table as torch tensors, over the fastest transport the
daemon and the tensors allow (:class:`EmbeddingCache`), and the modules a
training loop uses in place of ``torch.nn.Embedding`` /
``torch.nn.EmbeddingBag`` (:class:`Embedding`, :class:`EmbeddingBag`),
whose backward runs the optimizer in the table (``apply_gradients``), with
the next step's lookup prefetched while the current one computes
(:meth:`Embedding.prefetch`, :class:`Prefetcher`).

Needs torch; importing this module without it raises ImportError.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import sys
import threading
import time
import weakref
from typing import Callable, Iterable, List, NamedTuple, Optional, Sequence

import numpy as np
import torch

from . import BackingUnavailable, Client, ConnectionLost, HkvdError, ReservedKey, UnknownTable, WrongDim, _integers, region
from . import cuda as _cuda
from .cuda import CudaError, CudaIpcUnavailable
from .shm import shm_array

TRANSPORTS = ("cuda-ipc", "shm", "socket")
_NAMES = {"cuda-ipc": "CUDA IPC", "shm": "shared memory", "socket": "the socket"}


# The modules of each (socket, table), for steps that patch every module's
# prefetches, and the lock they take turns with (:func:`_in_turn`).
_SHARING: dict = {}
_TURNS: dict = {}


def _in_turn(method):
    """``method`` of a module run holding its table's turn: a forward, a
    prefetch, a step or a flush reads and changes the pending lookups and
    steps of every module of the table (``_SHARING``), so modules of one
    table used from several threads take turns (a tester's threads, each
    with its own module of one table, prefetching, took each other's
    lookups from their lists: IndexError, lookups read twice)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._turn:
            return method(self, *args, **kwargs)

    return run


def _device(device) -> torch.device:
    """``device`` as a torch device the rows can be copied to: the CPU, or
    a CUDA GPU torch sees. Refused here, when the cache or module is made,
    with what to give instead: torch's own errors came at the first
    forward ("Cannot copy out of meta tensor", "Found no NVIDIA driver")."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is no torch device ({e}): give 'cpu', 'cuda' or 'cuda:N'") from None
    if d.type == "cpu":
        return d
    if d.type != "cuda":
        raise ValueError(f"device {d} holds no data the table's rows can be copied into: give 'cpu', 'cuda' or "
                         f"'cuda:N' (or None: a GPU when torch sees one, else the CPU)")
    if not torch.cuda.is_available():
        raise ValueError(f"device {d}: torch sees no CUDA GPU here (torch.cuda.is_available() is False): give "
                         f"device='cpu', or None")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"device {d}: torch sees {torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
    return d


def _number(v, name: str) -> float:
    """``v`` as a float, when it is a real number (a Python or numpy
    number, a one-element tensor): a string ("0.1") or a bool is refused
    with a TypeError naming ``name``, not read as a number."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_complex and v.dtype != torch.bool:
        return float(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(v).__name__} {v!r}")
    return float(v)


def _readable(t: torch.Tensor) -> bool:
    """Whether the host may read ``t``'s values without waiting for a
    device: a tensor on the CPU (a prefetch checks its ids then)."""
    return not t.is_cuda


def _unsigned(ids) -> bool:
    """Whether the caller gave ids as uint64 (a torch or numpy array): a
    message then names an id as its uint64 value (2**64 - 1, not -1)."""
    if isinstance(ids, torch.Tensor):
        return ids.dtype == getattr(torch, "uint64", None)
    return np.asarray(ids).dtype == np.uint64


def _integer_ids(t: torch.Tensor, what: str = "ids") -> torch.Tensor:
    """``t`` when it holds integers (ids, offsets), else TypeError naming
    ``what``: float ids would be truncated silently (1.5 read as id 1)."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor (int64 preferred), not {t.dtype}")
    return t


# What the daemon's unknown_table says of a table dropped and created again
# since the connection last used it (PROTOCOL.md, "A table made again").
_MADE_AGAIN = "dropped and created again"

# The daemon's default limits.max_frame_bytes: the largest request body,
# which also bounds an answer and what a staged region request copies.
_MAX_FRAME_BYTES = 1 << 30


def _frame_keys(row_dim: int) -> int:
    """Most keys of one request whose body, answer and staged copies all fit
    the daemon's default frame bound, for rows of ``row_dim`` floats: a key,
    its row in and out, its found flag and a score, with room for the
    header."""
    return max(1, (_MAX_FRAME_BYTES - 4096) // (8 + 8 * row_dim + 1 + 8))


def _init_result(rows, call: str, n: int, dim: int, device: torch.device) -> torch.Tensor:
    """What an ``init`` function returned for ``n`` ids, as float32 rows on
    ``device``: a tensor or array of shape ``(n, dim)``. Anything else
    raises naming ``call`` and the shape wanted (a TypeError for what is
    no array, None say, where torch's own error read "must be real
    number, not NoneType"; a ValueError for another shape)."""
    want = f"a tensor (or array) of shape ({n}, {dim})"
    if rows is None:
        raise TypeError(f"{call} returned None for {n} ids, not {want}: does it lack a return?")
    try:
        t = torch.as_tensor(rows, dtype=torch.float32, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{call} returned {type(rows).__name__} for {n} ids, not {want} ({e})") from None
    if t.shape != (n, dim):
        raise ValueError(f"{call} returned shape {tuple(t.shape)} for {n} ids, not ({n}, {dim})")
    return t


def _rows_of(t: torch.Tensor, n: int, dim: int, what: str) -> torch.Tensor:
    """``t`` as ``n`` rows of ``dim`` (a ValueError naming the shapes when
    it is not ``n * dim`` elements)."""
    t = t.detach()
    if t.numel() != n * dim or (t.dim() >= 2 and t.shape[-1] != dim):
        raise ValueError(f"{n} ids need {what} of shape ({n}, {dim}) (the table's dim is {dim}), "
                         f"not of shape {tuple(t.shape)}")
    return t.reshape(n, dim)


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
    split; over ``shm`` and the socket ``max_batch`` is lowered to what one
    request under the daemon's default ``limits.max_frame_bytes`` (1 GiB)
    holds (about 3.9 M keys of 32 floats).

    On a table created with an ``optimizer``, ``dim`` is the table's value
    dim (``spec.dim``): lookups return the values only, rows are inserted
    with zero optimizer state, ``write_back`` refuses to reset the state
    to zero unless given ``reset_state=True`` (an optimizer without state,
    sgd, has none to lose), ``apply_gradients`` (which runs no optimizer)
    is refused, and
    :meth:`optimizer_step` runs the table's optimizer (apply_gradients).
    ``row_dim`` is the stored row's width (values and state), which the
    buffers hold.

    ``transport`` picks how the arrays reach the daemon:

    - ``cuda-ipc``: preallocated device buffers for ``max_batch`` keys
      (keys, values, gradients, found: one allocation) registered once with
      CUDA IPC; ids are copied into them on the GPU and the daemon reads and
      writes them in place, ordered with torch's current stream through
      interprocess events (``events=False``: the stream is synchronized
      instead). Needs ``device`` to be a GPU the daemon serves.
      apply_gradients on device memory runs in place too: the table's
      optimizer step is a kernel on the daemon's GPU.
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
        if init is not None and not callable(init):
            raise TypeError(f"init must be a callable (init(n, dim) -> rows) or None, not {type(init).__name__}")
        self.client = client
        self.table = table
        self.row_dim = client.dim(table)
        self.dim = client.value_dim(table)
        self.optimizer = client.optimizer(table)
        # The client's count of its own drops and creations of the table
        # now: one made again by this client since is not this cache's.
        self._made_at = client._made.get(table, 0)
        self.init = init
        self.max_batch = max_batch
        self.events = events
        self._done = None  # this cache's own done event (cuda-ipc, made on first use)
        # An optimizer step sent without waiting (optimizer_step(wait=False)):
        # (pending request, rows, values out, found out) until :meth:`settle`.
        self._inflight = None
        # The daemon's error that said the table was dropped and created
        # again since this cache's connection used it: raised again by
        # every later request of this cache (its dims are the old table's).
        self._remade: Optional[UnknownTable] = None
        # Ids absent from the table in the steps read by settle (not updated).
        self.missing = 0
        # Called when settle reads a refused optimizer step (it wrote
        # nothing), or none (the connection lost: whether it wrote is unknown).
        self.on_refused: Optional[Callable[[], None]] = None
        # Held by :meth:`settle` from taking the step in flight until its
        # answer is read: another thread may settle it (a request of a
        # shared client reads the deferred answers first, a module of the
        # same table settles its fellows), and this cache's own next
        # request must wait for that, not write its buffers while the
        # daemon may still read the step's keys and gradients from them (a
        # tester's threads sharing one client over shm stepped rows of
        # their next batch: -0.9 and -1.1 where -1.0 was due). Taken before
        # the client's ``_io``, never while holding it.
        self._settling = threading.RLock()
        # The thread on whose (thread-local) current stream a step's done
        # event was waited for, by whoever read its answer (cuda-ipc): a
        # request of this cache from another thread waits for it on its own
        # stream too (:meth:`_settle_own`); None: nothing owed.
        self._waited_by: Optional[int] = None
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = _device(device)
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
                # What the failed transport made is let go (an shm array
                # registered before a larger one failed held its region).
                for a in ("_buf", "_keys", "_values", "_found", "_grads", "_refs", "_grad_ref", "_out_ref",
                          "_keys_np", "_values_np", "_found_np", "_grads_np"):
                    self.__dict__.pop(a, None)
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
        m, w, d = self.max_batch, self.row_dim, self.dim
        # Gradient rows only for a table with an optimizer (apply_gradients).
        g = m if self.optimizer is not None else 0
        kb, vb, gb = _align(8 * m), _align(4 * m * w), _align(4 * g * d)
        # One allocation for the buffers: one region, one IPC open in the
        # daemon (the first open in a process costs ~100 ms).
        buf = self._device_buffer(kb + vb + gb + _align(m))
        self._buf = buf
        self._keys = buf[:8 * m].view(torch.int64)
        self._values = buf[kb:kb + 4 * m * w].view(torch.float32).view(m, w)
        self._found = buf[kb + vb + gb:kb + vb + gb + m]
        self._refs = [self.client.region_ref(x) for x in (self._keys, self._values, self._found)]
        if g:
            self._grads = buf[kb + vb:kb + vb + 4 * m * d].view(torch.float32).view(m, d)
            self._grad_ref = self.client.region_ref(self._grads)
            # apply_gradients' updated values: the first m × dim floats of the values buffer.
            self._out_ref = self.client.region_ref(self._values.reshape(-1)[:m * d].view(m, d))
        if self.events:
            try:
                region._own_events(self.client, self._refs[0].device)
            except (CudaIpcUnavailable, CudaError) as e:
                print(f"hkvd.torch: interprocess events unavailable ({e}); synchronizing the stream instead",
                      file=sys.stderr)
                self.events = False

    def _bound_batch(self) -> None:
        """A transport whose requests the daemon copies (shm, socket): at
        most as many keys a request as the default frame bound allows
        (:func:`_frame_keys`), so that a large ``max_batch`` is split
        instead of refused as ``oversized``."""
        self.max_batch = min(self.max_batch, _frame_keys(self.row_dim))

    def _setup_shm(self) -> None:
        self._bound_batch()
        m, w, d = self.max_batch, self.row_dim, self.dim
        try:
            self._keys_np = shm_array((m,), np.int64)
            self._values_np = shm_array((m, w), np.float32)
            self._found_np = shm_array((m,), np.uint8)
        except OSError as e:
            need = m * (8 + 4 * w + 1 + (4 * d if self.optimizer is not None else 0))
            raise OSError(e.errno, f"shared memory for max_batch {m} ({need} bytes of buffers) could not be "
                                   f"made ({e.strerror}): lower max_batch") from e
        self._refs = [self.client.region_ref(x) for x in (self._keys_np, self._values_np, self._found_np)]
        if self.optimizer is not None:
            self._grads_np = shm_array((m, d), np.float32)
            self._grad_ref = self.client.region_ref(self._grads_np)
            self._out_ref = self.client.region_ref(self._values_np.reshape(-1)[:m * d].reshape(m, d))

    def _setup_socket(self) -> None:
        self._bound_batch()
        self._refs = []

    # ---- helpers ------------------------------------------------------
    def _sync_args(self):
        if self.events:
            return {"wait": True, "done": True}
        return {"wait": False, "done": False}

    def _ids(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            t = _integer_ids(ids)
        else:
            a = np.asarray(ids)
            _integers(a, "ids")
            t = torch.from_numpy(np.ascontiguousarray(a.view(np.int64) if a.dtype == np.uint64 else a.astype(np.int64)))
        if t.dtype != torch.int64:
            t = t.to(torch.int64)
        return t.reshape(-1)

    def _init_rows(self, n: int) -> torch.Tensor:
        return _init_result(self.init(n, self.dim), f"init({n}, {self.dim})", n, self.dim, self.device)

    def _fill(self, keys: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
        """cuda-ipc: a lookup's or write's keys and rows into this cache's
        buffers, on the current stream (:meth:`_send` does it first, unless
        given ``after``)."""
        m, d, w = keys.numel(), self.dim, self.row_dim
        self._keys[:m].copy_(keys, non_blocking=True)
        v = self._values[:m]
        if rows is None:
            v.zero_()
        else:
            v[:, :d].copy_(rows, non_blocking=True)
            if w > d:
                v[:, d:].zero_()

    def _send(self, op: int, keys: torch.Tensor, rows: Optional[torch.Tensor], done_event: bool = True,
              after=None):
        """Sends one chunk of at most max_batch keys (``rows``: values or
        deltas, ``dim`` wide, the state columns sent as zeros; None: zeros)
        without waiting; :meth:`_recv` reads the answer. One request per
        cache is in flight at a time (its buffers are the request's).
        ``done_event`` False: the request may stay in flight while others
        go out on the connection, so on cuda-ipc it does not use the
        connection's done event but this cache's own (made on first use):
        the daemon answers as soon as its kernels are queued, and
        :meth:`_recv` makes the current stream wait for that event (without
        events, the request is answered once its outputs are written).
        ``after`` (cuda-ipc with events): the done event of a request of
        this client still in flight whose writes this one must follow; the
        keys and rows were put in the buffers (:meth:`_fill`) before that
        request was sent, and its answer is not read first
        (``region.After``)."""
        self._settle_own()
        self._refuse_if_remade()
        m = keys.numel()
        c = self.client
        d, w = self.dim, self.row_dim
        if self.transport == "cuda-ipc":
            if after is None:
                self._fill(keys, rows)
            k, vr = self._refs[0].head(m), self._refs[1].head(m)
            sync = self._sync_args()
            if not done_event and self.events:
                if self._done is None:
                    self._done = region.cuda_event(c, self._refs[0].device)
                sync["done"] = self._done
            if after is not None:
                sync["wait"] = region.After(after)
            return ("region", region.send(c, op, self.table, [k, vr], **sync), m)
        if self.transport == "shm":
            np.copyto(self._keys_np[:m], keys.cpu().numpy())
            v = self._values_np[:m]
            if rows is None:
                v[...] = 0.0
            else:
                np.copyto(v[:, :d], rows.detach().cpu().numpy())
                if w > d:
                    v[:, d:] = 0.0
            return ("region", region.send(c, op, self.table, [self._refs[0].head(m), self._refs[1].head(m)]), m)
        k = keys.cpu().numpy().view(np.uint64)
        v = np.zeros((m, w), dtype=np.float32)
        if rows is not None:
            v[:, :d] = rows.detach().cpu().numpy()
        return ("socket", c.send_write(op, self.table, k, v), m)

    def _refuse_if_remade(self) -> None:
        """Raises, before a request is sent, the error that said the table
        was made again since this cache was made for it; or says so first
        where this cache's own client dropped or created the table since
        (the daemon refuses such a request only on another connection:
        PROTOCOL.md, "A table made again"; a tester's module read the first
        columns of the new table's rows as its own)."""
        if self._remade is None and self.client._made.get(self.table, 0) != self._made_at:
            how = "dropped and created again" if self.table in self.client._dims else "dropped"
            self._remade = UnknownTable("unknown_table", f"table {self.table!r} was {how} by this cache's client "
                                                         f"since the cache was made for it: make a new one for it")
        if self._remade is not None:
            raise UnknownTable(self._remade.code, self._remade.message)

    @contextlib.contextmanager
    def _noting_remade(self):
        """An answer read inside that says the table was dropped and
        created again (refused once by the daemon) is kept: every later
        request of this cache raises it too (:meth:`_refuse_if_remade`)."""
        try:
            yield
        except UnknownTable as e:
            if _MADE_AGAIN in e.message:
                self._remade = e
            raise

    def _recv(self, token, out: Optional[torch.Tensor]) -> None:
        """The answer of :meth:`_send`'s request; find_or_insert's rows
        (their values) copied to ``out``."""
        with self._noting_remade():
            self._recv_noted(token, out)

    def _recv_noted(self, token, out: Optional[torch.Tensor]) -> None:
        kind, p, m = token
        d = self.dim
        if kind == "region":
            if p is not None:
                region.finish(self.client, p)
                if self.transport == "cuda-ipc" and p.post is None and self._done is not None:
                    # Sent with this cache's own done event (``_send``).
                    self._done.wait(_cuda.torch_stream(self.device.index))
            if out is not None:
                src = self._values[:m, :d] if self.transport == "cuda-ipc" else torch.from_numpy(self._values_np[:m, :d])
                out.copy_(src)
            return
        r = self.client.result(p)
        if out is not None:
            out.copy_(torch.from_numpy(r["values"][:, :d]))

    def _op(self, op: int, keys: torch.Tensor, rows: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> None:
        self._recv(self._send(op, keys, rows), out)

    def _chunks(self, op: int, keys: torch.Tensor, rows: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> None:
        for s in range(0, keys.numel(), self.max_batch):
            e = min(s + self.max_batch, keys.numel())
            self._op(op, keys[s:e], None if rows is None else rows[s:e], None if out is None else out[s:e])

    def _done_sync(self) -> dict:
        """The events of a request that may stay in flight while others go
        out on the connection: on cuda-ipc this cache's own done event
        (made on first use), which :meth:`_recv` / :meth:`settle` make the
        current stream wait for."""
        sync = self._sync_args()
        if self.events:
            if self._done is None:
                self._done = region.cuda_event(self.client, self._refs[0].device)
            sync["done"] = self._done
        return sync

    def _step_chunk(self, keys: torch.Tensor, grads: torch.Tensor, hyper: dict, out: Optional[torch.Tensor],
                    found: Optional[torch.Tensor], wait: bool = True, views: bool = False, sum: bool = False) -> int:
        self._settle_own()
        self._refuse_if_remade()
        with self._noting_remade():
            return self._step_chunk_noted(keys, grads, hyper, out, found, wait, views, sum)

    def _step_chunk_noted(self, keys: torch.Tensor, grads: torch.Tensor, hyper: dict, out: Optional[torch.Tensor],
                          found: Optional[torch.Tensor], wait: bool, views: bool, sum: bool) -> int:
        m = keys.numel()
        c = self.client
        want = out is not None or views
        flags = region.F_SUM if sum else 0
        if self.transport == "socket":
            k = keys.cpu().numpy().view(np.uint64)
            r = c.apply_gradients(self.table, k, grads.detach().cpu().numpy(), values=want, sum=sum, **hyper)
            if not want:
                return r
            missing, f, v = r
            out.copy_(torch.from_numpy(v))
            found.copy_(torch.from_numpy(f))
            return missing
        if self.transport == "cuda-ipc":
            self._keys[:m].copy_(keys, non_blocking=True)
            if grads.data_ptr() != self._grads.data_ptr():  # else summed in place (_Sparse._grad_rows)
                self._grads[:m].copy_(grads, non_blocking=True)
        else:
            np.copyto(self._keys_np[:m], keys.cpu().numpy())
            np.copyto(self._grads_np[:m], grads.detach().cpu().numpy())
        arrays = [self._refs[0].head(m), self._grad_ref.head(m)]
        if want:
            arrays += [self._refs[2].head(m), self._out_ref.head(m)]
        if not wait:
            sync = self._done_sync() if self.transport == "cuda-ipc" else {}
            p = region.send(c, region.OP_APPLY_GRADIENTS, self.table, arrays, False, want,
                            head=_hyper_bytes(**hyper), flags=flags, **sync)
            if p is not None:
                self._inflight = (p, m, out, found)
                if self.settle not in c._deferred:
                    c._deferred.append(self.settle)
            return 0
        sync = self._sync_args() if self.transport == "cuda-ipc" else {}
        body = region.call(c, region.OP_APPLY_GRADIENTS, self.table, arrays, False, want,
                           head=_hyper_bytes(**hyper), flags=flags, **sync)
        missing = region.count(body)
        if want:
            self._copy_out(m, out, found)
        return missing or 0

    def settle(self, by: Optional[str] = None) -> None:
        """Reads the answer of the optimizer step sent without waiting
        (``optimizer_step(wait=False)``), if one is in flight: its count of
        absent ids is added to ``missing``, its updated values copied to
        the ``values`` it returned, and on cuda-ipc the current stream then
        follows its writes. Every request of this cache, and every later
        request of its client, does this first. ``by`` names who reads it
        for the step's error (``"flush()"``); None: the request about to be
        sent, which the error then stops.

        Safe from any thread: one that finds the step being read by another
        waits until its answer is in."""
        with self._settling:
            self._settle_locked(by)

    def _settle_own(self) -> None:
        """:meth:`settle` before a request of this cache, which writes its
        buffers: on cuda-ipc the current stream then also follows a step
        whose answer another thread read (:attr:`_waited_by`)."""
        self.settle()
        by, self._waited_by = self._waited_by, None
        if by is not None and by != threading.get_ident():
            self._done.wait(_cuda.torch_stream(self.device.index))

    def _settle_locked(self, by: Optional[str]) -> None:
        f = self._inflight
        if f is None:
            return
        self._inflight = None
        p, m, out, found = f
        try:
            with self._noting_remade():
                body = region.finish(self.client, p)
        except BaseException as e:
            # The step wrote nothing: its found flags say so (zeros), so
            # that no prefetched row is patched from its buffers.
            if found is None:
                self._found_flags(m).zero_()
            if isinstance(e, HkvdError):
                if self.on_refused is not None:
                    self.on_refused()
                # Raised by whatever came next: say whose it is.
                when = "read before this request, which was not sent" if by is None else f"read by {by}"
                if isinstance(e, ConnectionLost):
                    # No answer came: the daemon may have applied the step
                    # before it stopped (a tester's SIGKILL and SIGTERM
                    # were told it was "refused").
                    what = ("got no answer: the connection was lost or closed first, so whether the daemon "
                            "applied it is unknown")
                    when = "found by this request, which was not sent" if by is None else f"found by {by}"
                elif isinstance(e, BackingUnavailable) and "may have reached" in e.message:
                    # The daemon's words for a write a cluster node failed
                    # mid-way: a stalled node runs it when it resumes (a
                    # tester's every row had the step said "not applied").
                    what = ("may have been applied: a node of the table's cluster failed or stalled mid-write, "
                            "and a stalled node runs the write when it resumes, so whether (and to which rows) "
                            "it was applied is unknown")
                else:
                    what = "was refused and not applied"
                raise type(e)(e.code, f"the optimizer step of table {self.table!r} that the last backward sent "
                                      f"{what} ({when}): {e.message}") from e
            raise
        if self.transport == "cuda-ipc" and p.post is None and self._done is not None:
            self._done.wait(_cuda.torch_stream(self.device.index))
            self._waited_by = threading.get_ident()
        self.missing += region.count(body) or 0
        if out is not None:
            self._copy_out(m, out, found)

    def step_views(self, uniq: torch.Tensor, grads: torch.Tensor, **hyper):
        """:meth:`optimizer_step` of at most ``max_batch`` distinct ids, sent
        without waiting, its outputs left where the daemon writes them:
        returns ``(found, rows)``, a uint8 ``(n,)`` and a float32 ``(n,
        dim)`` view of this cache's buffers, written once :meth:`settle` ran
        and valid until this cache's next request (copy them to keep them).
        Not on the socket transport (its answers are read at once)."""
        n = uniq.numel()
        if self.transport == "socket" or n > self.max_batch:
            raise ValueError("step_views needs a region transport and at most max_batch ids")
        g = grads.detach().reshape(n, self.dim).to(device=self.device, dtype=torch.float32)
        self._step_chunk(uniq, g, hyper, None, None, wait=False, views=True)
        if self.transport == "cuda-ipc":
            return self._found_flags(n), self._values.reshape(-1)[:n * self.dim].view(n, self.dim)
        return self._found_flags(n), torch.from_numpy(self._values_np.reshape(-1)[:n * self.dim].reshape(n, self.dim))

    def _found_flags(self, m: int) -> torch.Tensor:
        """The first ``m`` found flags of this cache's buffer (uint8)."""
        return self._found[:m] if self.transport == "cuda-ipc" else torch.from_numpy(self._found_np[:m])

    def _copy_out(self, m: int, out: torch.Tensor, found: torch.Tensor) -> None:
        if self.transport == "cuda-ipc":
            out.copy_(self._values.reshape(-1)[:m * self.dim].view(m, self.dim))
            found.copy_(self._found[:m].bool())
        else:
            out.copy_(torch.from_numpy(self._values_np.reshape(-1)[:m * self.dim].reshape(m, self.dim)))
            found.copy_(torch.from_numpy(self._found_np[:m].astype(bool)))

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

    def lookup_unique(self, uniq: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows of distinct ids ``uniq`` (1-D int64 on ``device``): find_or_insert,
        with ``rows`` (``(n, dim)``; None: zeros) inserted for unknown ids."""
        out = torch.empty((uniq.numel(), self.dim), dtype=torch.float32, device=self.device)
        if uniq.numel():
            self._chunks(region.OP_FIND_OR_INSERT, uniq, rows, out)
        return out

    def apply_gradients(self, ids, grads: torch.Tensor, lr: float) -> None:
        """Adds ``-lr * grads`` to the rows of ``ids`` (``grads``: shape
        ``ids.shape + (dim,)`` or ``(n, dim)``); repeated ids get the sum of
        their gradients. A table created with an optimizer refuses it
        (ValueError): this is accum_or_assign, not the table's optimizer,
        which :meth:`optimizer_step` runs."""
        if self.optimizer is not None:
            # A tester's adagrad table got plain SGD here, its accumulators
            # untouched: the client's apply_gradients of the same name runs
            # the table's optimizer, and this one cannot (no eps, betas or
            # Adam step count). Refused as write_back refuses to reset the
            # state, pointing to what trains such rows.
            raise ValueError(f"table {self.table!r} has optimizer {self.optimizer}, and "
                             f"EmbeddingCache.apply_gradients adds -lr * grads to the values (accum_or_assign) "
                             f"without it: use optimizer_step(uniq, grads, lr, ...) to run the table's optimizer "
                             f"(or hkvd.torch.Embedding)")
        flat = self._ids(ids)
        if flat.numel() == 0:
            return
        g = _rows_of(grads, flat.numel(), self.dim, "gradient rows").to(device=self.device, dtype=torch.float32)
        uniq, inv = torch.unique(flat.to(self.device), return_inverse=True)
        summed = torch.zeros((uniq.numel(), self.dim), dtype=torch.float32, device=self.device)
        summed.index_add_(0, inv, g)
        summed.mul_(-float(lr))
        self._chunks(region.OP_ACCUM_OR_ASSIGN, uniq, summed, None)

    def optimizer_step(self, uniq: torch.Tensor, grads: torch.Tensor, lr: float, eps: float = 1e-8,
                       beta1: float = 0.9, beta2: float = 0.999, weight_decay: float = 0.0, step: int = 1,
                       values: bool = False, wait: bool = True):
        """One step of the table's optimizer (apply_gradients) for distinct
        ids ``uniq`` (1-D) with their gradient rows ``grads`` (``(n, dim)``;
        reduce repeated ids first). Returns the count of ids absent from the
        table (not updated) and, with ``values``, ``(missing, found (n,)
        bool, rows (n, dim))``: the values after the step, on ``device``.

        ``wait`` False: the (last) request is sent without waiting for its
        answer, which :meth:`settle` reads: the next request of this cache
        or of its client, whichever comes first, so that request sees the
        step's writes. The count returned is then 0 (the absent ids are
        added to ``self.missing`` when read), and ``found`` and ``rows`` are
        written when read (on cuda-ipc: queued on the stream current then).
        An error of the step is raised by the request that reads it."""
        if self.optimizer is None:
            raise ValueError(f"table {self.table!r} has no optimizer: create it with optimizer= "
                             "(sgd, adagrad, rowwise_adagrad or adam)")
        n = uniq.numel()
        g = grads.detach().reshape(n, self.dim).to(device=self.device, dtype=torch.float32)
        hyper = dict(lr=float(lr), eps=float(eps), beta1=float(beta1), beta2=float(beta2),
                     weight_decay=float(weight_decay), step=self.client._step(self.table, step))
        out = torch.empty((n, self.dim), dtype=torch.float32, device=self.device) if values else None
        # Zeros until the answer is read: a step that fails found no row.
        found = torch.zeros(n, dtype=torch.bool, device=self.device) if values else None
        missing = 0
        for s in range(0, n, self.max_batch):
            e = min(s + self.max_batch, n)
            missing += self._step_chunk(uniq[s:e], g[s:e], hyper, None if out is None else out[s:e],
                                        None if found is None else found[s:e], wait=wait or e < n)
        return (missing, found, out) if values else missing

    def write_back(self, ids, rows: torch.Tensor, *, reset_state: bool = False) -> None:
        """Stores ``rows`` for ``ids`` (insert_or_assign). A row is stored
        whole, so on a table whose optimizer keeps state (adagrad,
        rowwise_adagrad, adam) the ids' state would be replaced with zeros:
        that is refused (ValueError) unless ``reset_state`` is True. Train
        such rows with :meth:`optimizer_step` (or the modules), or store
        values and state together with ``client.insert_or_assign`` rows of
        ``row_dim`` floats."""
        if self.row_dim > self.dim and not reset_state:
            raise ValueError(f"table {self.table!r} keeps {self.optimizer} state beside each row's values, and "
                             f"write_back stores whole rows: it would reset the state of these ids to zeros. Pass "
                             f"reset_state=True to do that; to train the rows use optimizer_step (or "
                             f"hkvd.torch.Embedding); to set values and state, client.insert_or_assign rows of "
                             f"{self.row_dim} floats (values, then state)")
        flat = self._ids(ids).to(self.device)
        r = _rows_of(rows, flat.numel(), self.dim, "rows").to(device=self.device, dtype=torch.float32)
        self._chunks(region.OP_INSERT_OR_ASSIGN, flat, r, None)


def _hyper_bytes(lr: float, eps: float, beta1: float, beta2: float, weight_decay: float, step: int) -> bytes:
    from . import hyper_bytes

    return hyper_bytes(lr, eps, beta1, beta2, weight_decay, step)


# ---- modules --------------------------------------------------------------

class _Prefetched:
    """A lookup sent ahead (:meth:`_Sparse.prefetch`): the ids it is for,
    their distinct ids and inverse, the cache whose buffers it uses, the
    request token, and the updates made since it was sent."""

    def __init__(self, ids, uniq, inv, cache, token):
        # The caller's ids (not copied) with the mark of their memory and
        # version: what they held is known while the version is unchanged.
        # A tensor without a version counter (made in inference mode) is
        # copied: the copy is what it held.
        self.mark = _mark(ids)
        try:
            self.ids, self.version = ids, ids._version
        except RuntimeError:
            self.ids, self.version = ids.clone(), None
        self.uniq, self.inv, self.cache, self.token = uniq, inv, cache, token
        self.patches: List[tuple] = []

    def matches(self, flat: torch.Tensor) -> bool:
        """Whether ``flat`` holds the prefetched ids: the same memory,
        unchanged since (no device sync), else compared element by element
        with the prefetched tensor while that is unchanged (once written in
        place, what it held is not known: no match, the forward looks up)."""
        if self.mark is not None and _mark(flat) == self.mark:
            return True
        if self.version is not None and self.ids._version != self.version:
            return False
        return self.ids.shape == flat.shape and bool(torch.equal(self.ids, flat))


def _mark(t: torch.Tensor):
    """What identifies a tensor's contents without reading them: its
    memory, shape, strides and the version counter that in-place writes bump."""
    try:
        return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t._version)
    except (RuntimeError, AttributeError):
        return None


class _Gather(torch.autograd.Function):
    """rows[inv] forward; backward sums the gradient per distinct id
    (index_add_ on the gradient's device) and hands it to the module's
    table (one apply_gradients), so after ``loss.backward()`` the table is
    updated. ``anchor`` is a 0-d tensor that requires grad, so that
    autograd calls this backward."""

    @staticmethod
    def forward(ctx, anchor, rows, inv, uniq, module):
        ctx.module = module
        ctx.n = rows.shape[0]
        ctx.save_for_backward(inv, uniq)
        return rows.index_select(0, inv)

    @staticmethod
    def backward(ctx, grad):
        inv, uniq = ctx.saved_tensors
        with ctx.module._turn:
            g = ctx.module._grad_rows(ctx.n, grad.device)
            g.index_add_(0, inv, grad.reshape(-1, grad.shape[-1]).to(torch.float32))
            with ctx.module._remade_named():
                ctx.module._apply_step(uniq, g)
        return None, None, None, None, None


class _Positions(torch.autograd.Function):
    """The rows of every position of the ids, as the table's find_or_insert
    answered them (no deduplication on this side); backward hands the
    gradient of every position to the table, which sums a repeated id's
    gradients and steps it once (apply_gradients with SUM)."""

    @staticmethod
    def forward(ctx, anchor, rows, flat, module):
        ctx.module = module
        ctx.save_for_backward(flat)
        return rows

    @staticmethod
    def backward(ctx, grad):
        (flat,) = ctx.saved_tensors
        with ctx.module._turn, ctx.module._remade_named():
            ctx.module._apply_positions(flat, grad.reshape(-1, grad.shape[-1]))
        return None, None, None, None


def _uncount_step(module: "_Sparse") -> Callable[[], None]:
    """What a module's cache calls when it reads a refused step: the
    module's step count goes back by one (held weakly: the cache does not
    keep the module alive)."""
    ref = weakref.ref(module)

    def uncount() -> None:
        m = ref()
        if m is not None:
            m.step -= 1

    return uncount


class _Sparse(torch.nn.Module):
    """What :class:`Embedding` and :class:`EmbeddingBag` share: the table,
    its transport, the optimizer's hyperparameters and step count,
    lookups (prefetched or not) and the step of the backward."""

    def __init__(self, client: Client, table: str, *, lr: float = 0.01, eps: float = 1e-8,
                 betas: Sequence[float] = (0.9, 0.999), weight_decay: float = 0.0,
                 init: Optional[Callable] = None, device=None, transport: str = "auto", max_batch: int = 1 << 16,
                 events: bool = True, verbose: bool = True, dedupe: str = "table"):
        super().__init__()
        if dedupe not in ("module", "table"):
            raise ValueError(f"dedupe must be module or table, not {dedupe!r}")
        if init is not None and not callable(init):
            # Else refused only at the first forward of an unknown id.
            raise TypeError(f"init must be a callable (init(ids) -> rows) or None, not {type(init).__name__}")
        # "table": every position's id goes to the table as it is; the
        # table answers a row per position and sums a repeated id's
        # gradients itself (apply_gradients with SUM). "module": the ids
        # are deduplicated here (torch.unique) and the gradients summed here.
        self.dedupe = dedupe
        # The table and the arguments first: a module refused here made no
        # buffers and printed no transport line.
        if client.policy(table) == "custom":
            raise ValueError(f"table {table!r} has policy custom, whose writes need the caller's score per key; "
                             "this module's lookups (find_or_insert) and steps give none: use another policy")
        self.optimizer = client.optimizer(table)
        if self.optimizer is None:
            raise ValueError(f"table {table!r} has no optimizer: create it with optimizer= (sgd, adagrad, "
                             "rowwise_adagrad or adam), e.g. client.create_table(name, dim, capacity, "
                             "optimizer='rowwise_adagrad')")
        self.client, self.table = client, table
        self.lr, self.eps = _number(lr, "lr"), _number(eps, "eps")
        self.weight_decay = _number(weight_decay, "weight_decay")
        if isinstance(betas, (str, bytes)) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers (beta1, beta2), not {betas!r}")
        self.betas = (_number(betas[0], "betas[0]"), _number(betas[1], "betas[1]"))
        # As the table checks them at each step (shard/src/optim.rs), but
        # now: a step refused later is a step lost.
        for name, v in (("lr", self.lr), ("eps", self.eps), ("weight_decay", self.weight_decay),
                        ("betas[0]", self.betas[0]), ("betas[1]", self.betas[1])):
            if not math.isfinite(v):
                raise ValueError(f"{name} {v} is not a finite number")
        if self.lr < 0 or self.eps < 0:
            raise ValueError(f"lr {self.lr} and eps {self.eps} must not be negative")
        if self.optimizer == "adam" and not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Adam's betas {self.betas} must lie in [0, 1)")
        self.cache = EmbeddingCache(client, table, device=device, max_batch=max_batch, transport=transport,
                                    events=events, verbose=verbose)
        self.dim = self.cache.dim
        self.device = self.cache.device
        self.init = init
        self.step = 0
        self._missing = 0
        # The error that said the table was made again under this module,
        # raised again by every later forward.
        self._remade: Optional[HkvdError] = None
        self._anchor = torch.zeros((), requires_grad=True)
        self._pending: List[_Prefetched] = []
        # dedupe "table": the ids prefetch() was given, sent after this
        # module's next step; and the lookups sent so, unanswered.
        self._pos_next: Optional[_Prefetched] = None
        self._pos_pending: List[_Prefetched] = []
        self._spare: List[EmbeddingCache] = []
        self._kw = dict(device=self.device, max_batch=max_batch, transport=self.cache.transport, events=events,
                        verbose=False)
        self.timings = {"lookup": 0.0, "apply": 0.0}
        # Forwards served by a prefetch, and prefetched rows patched with
        # the values a later step's apply_gradients returned.
        self.prefetch_hits = 0
        self._patched: list = []  # each patch's count (0-d tensors on the device), summed when asked
        # The modules of this table (this one among them): a step of any
        # patches the prefetches pending in all.
        self._turn = _TURNS.setdefault((client.path, table), threading.RLock())
        with self._turn:
            self._sharing = _SHARING.setdefault((client.path, table), weakref.WeakSet())
            self._sharing.add(self)
        self.cache.on_refused = _uncount_step(self)

    def _step_sent(self, send: Callable[[], None]) -> None:
        """Runs ``send``, which sends this module's step (``self.step``
        already counts it); a step that raises was not applied, and is not
        counted (Adam's bias correction then goes on from the last step
        applied)."""
        try:
            send()
        except HkvdError:
            self.step -= 1
            raise

    def _members(self) -> List["_Sparse"]:
        """The modules of this table (this one among them) whose connection
        is not known lost or closed: a module left over from before a
        restart of the daemon (its client got ``ConnectionLost``), or whose
        client was closed, is none of a new one's (a tester's new module
        sent such a module's pending lookup again on its closed socket, and
        got ``Bad file descriptor`` after its own step was applied)."""
        return [m for m in list(self._sharing) if m is self or not (m.client.lost or m.client.closed)]

    def _settle_sharing(self) -> None:
        """Reads the answers of the steps in flight of every module of this
        table (each module's last step), so that what follows sees them. A
        module on another client whose connection turns out lost here
        leaves the table's modules (its step's answer is lost with it)."""
        for m in self._members():
            try:
                m.cache.settle()
            except ConnectionLost:
                if m.client is self.client:
                    raise

    # ---- lookups ------------------------------------------------------
    def _flat(self, ids) -> torch.Tensor:
        t = _integer_ids(ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids)))
        return t.reshape(-1).to(device=self.device, dtype=torch.int64)

    def _init_rows(self, uniq: torch.Tensor) -> Optional[torch.Tensor]:
        if self.init is None:
            return None
        return _init_result(self.init(uniq), "init(ids)", uniq.numel(), self.dim, self.device)

    @_in_turn
    def prefetch(self, ids) -> None:
        """With ``dedupe="table"``: keeps ``ids`` (the next step's), whose
        lookup this module's next step sends right behind itself (over CUDA
        IPC without waiting for the step's answer: the daemon runs it after
        the step), so that it reads the step's writes and needs no patch;
        the forward called with equal ids uses its rows. A step of another
        module of the table sends it again behind that step. With autograd
        off (``torch.no_grad()``: evaluation, inference) no step comes, so
        the lookup is sent now. With ``"module"``, and for a batch of more
        positions than ``max_batch`` (whose forward takes the module's
        deduplication), as follows. Sends the
        lookup of ``ids`` now, without waiting: the daemon runs it while
        this step computes, and the forward called with equal ids uses its
        rows. Rows that a step updates meanwhile (this module's, or another
        module's of the same table) are patched with the values apply_gradients returns, so the
        rows the forward sees are those an unprefetched lookup would have
        read (bit for bit). A forward uses the first pending prefetch of
        its ids and drops those sent before it; one whose ids none holds
        leaves them pending. At most two are kept (a third drops the
        oldest); batches of more than ``max_batch`` distinct ids are looked
        up at the forward instead. A prefetch inserts the ids the table
        lacks (find_or_insert) when it is sent, used or not. The forward's
        ids match when they are the same tensor memory, unchanged since
        (torch's version counter: no device sync), or else equal element
        by element; a change made behind torch's back (through a numpy
        array sharing the memory, or ``.data``) is not noticed: give the
        forward a new tensor then.

        Ids on the CPU are checked first, as the table checks them: one of
        the reserved ids (-4 to -1, 2**64 - 4 and up as uint64) raises
        ``ReservedKey`` now, naming its place, and nothing is sent (ids on
        a GPU are not read here: the forward that would use the lookup
        raises the table's refusal, and one no forward uses is dropped)."""
        self._refuse_if_remade()
        src = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids))
        if _readable(src):
            bad = self._reserved_at(None, _integer_ids(src).reshape(-1).to(torch.int64), _unsigned(ids),
                                    "the ids given to prefetch()",
                                    "nothing was looked up: prefetch() takes the ids that the next forward takes "
                                    "(a Prefetcher's loader gives the ids raw: map them as the forward does, say "
                                    "Prefetcher(loader, [(module, lambda b: b[0].clamp(min=0))]))")
            if bad is not None:
                raise bad
        flat = self._flat(src)
        if self.dedupe == "table" and flat.numel() <= self.cache.max_batch:
            # Sent after this module's next step (so that it reads the
            # step's writes): no patch, no deduplication here.
            if flat.numel() > 0:
                p = _Prefetched(flat, None, None, None, None)
                if torch.is_grad_enabled():
                    self._pos_next = p
                else:
                    self._lookup_now(p)
            return
        # The module's deduplication: dedupe "module", or a batch of more
        # positions than max_batch, whose forward takes it too
        # (:meth:`_gathered`): its lookup sent now, patched after the step
        # (a tester's DLRM batches of 4096 x 26 ids were not prefetched at
        # all under the defaults, silently).
        uniq, inv = torch.unique(flat, return_inverse=True)
        if uniq.numel() > self.cache.max_batch or uniq.numel() == 0:
            return
        # The last steps' answers first (this table's, by any module): their
        # done events then order this lookup after their writes on the GPU.
        self._settle_sharing()
        while len(self._pending) >= 2:
            self._drop(self._pending.pop(0))
        p = _Prefetched(flat, uniq, inv, None, None)
        p.cache = self._spare_cache()
        t0 = time.perf_counter()
        try:
            p.token = p.cache._send(region.OP_FIND_OR_INSERT, uniq, self._init_rows(uniq), done_event=False)
        except BaseException:
            self._spare.append(p.cache)
            raise
        self.timings["lookup"] += time.perf_counter() - t0
        self._pending.append(p)

    def _lookup_now(self, p: _Prefetched) -> None:
        """dedupe "table", autograd off: sends the lookup of ``p``'s ids now,
        after the steps in flight of the table's modules (their answers
        read first); a later step drops it and sends it again behind itself
        (:meth:`_drop_table_lookups`)."""
        self._settle_sharing()
        t0 = time.perf_counter()
        p.cache = self._spare_cache()
        try:
            p.token = p.cache._send(region.OP_FIND_OR_INSERT, p.ids, self._init_rows(p.ids), done_event=False)
        except BaseException:
            self._spare.append(p.cache)
            raise
        self._pos_pending.append(p)
        while len(self._pos_pending) > 2:  # unused ones: at most two kept
            self._drop(self._pos_pending.pop(0))
        self.timings["lookup"] += time.perf_counter() - t0

    def _spare_cache(self) -> EmbeddingCache:
        """A cache for a lookup sent ahead: a spare one, else a new one,
        which refuses what the module's own cache refuses (a table this
        module's client made again since the module was made)."""
        if self._spare:
            return self._spare.pop()
        c = EmbeddingCache(self.client, self.table, **self._kw)
        c._made_at = self.cache._made_at
        return c

    @property
    def transport(self) -> str:
        """The transport the module's lookups and steps use (``cuda-ipc``,
        ``shm`` or ``socket``)."""
        return self.cache.transport

    @property
    def missing(self) -> int:
        """Ids whose row was gone when their step came (their gradient was
        dropped), over the steps whose answers were read."""
        return self._missing + self.cache.missing

    @_in_turn
    def flush(self) -> None:
        """Waits for the last optimizer step's answer (the backward sends it
        without waiting) and raises its error, if any. Any later request of
        the module or of its client reads it first anyway, so only a reader
        on another connection needs this before it sees the step's rows.
        Raises ``ConnectionLost`` when the module's connection was lost
        (its last step's answer with it), so that a ``finally: flush()``
        does not report success."""
        if self.client.lost:
            raise ConnectionLost("connection_lost",
                                 f"the connection of the module of table {self.table!r} was lost; whether its last "
                                 "optimizer step was applied is unknown: check the rows, or restore a checkpoint, "
                                 "with a new client")
        with self._remade_named():
            self.cache.settle(by="flush()")

    def _drop(self, p: _Prefetched) -> bool:
        """Reads and discards the answer of ``p``, a lookup sent ahead that
        no forward uses (its cache goes back to the spares). Its token is
        spent first, whatever the answer: a lookup read twice waited for an
        answer that never comes (a tester's refused prefetch stayed in the
        pending list, and the next step hung reading it again). A refusal
        is dropped with it: the daemon changed nothing, and the forwards
        that follow send their own lookups, which say what is wrong; only
        a lost connection is raised, and a table made again is kept for
        every later forward to raise (the daemon says it once). Returns
        whether the lookup was answered with rows (a refused one is not
        worth sending again)."""
        token, p.token = p.token, None
        try:
            if token is not None:
                p.cache._recv(token, None)
        except ConnectionLost:
            raise
        except UnknownTable as e:
            self._made_again(e)
            return False
        except HkvdError:
            return False
        finally:
            self._spare.append(p.cache)
        return token is not None

    def _take(self, p: _Prefetched, rows: torch.Tensor) -> None:
        """The rows of ``p``, a lookup sent ahead that this forward uses,
        into ``rows`` (its cache goes back to the spares); its error, if the
        daemon refused it, is raised as the prefetch's."""
        token, p.token = p.token, None
        try:
            p.cache._recv(token, rows)
        except ConnectionLost:
            raise
        except HkvdError as e:
            err = type(e)(e.code, f"the lookup that prefetch() sent ahead for these ids was refused: {e.message}")
            err.prefetched = True
            raise err from e
        finally:
            self._spare.append(p.cache)
        self.prefetch_hits += 1

    def _lookup(self, flat: torch.Tensor):
        """(uniq, inv, rows) of flat ids: a matching prefetch's rows
        (patched), else a lookup now."""
        t0 = time.perf_counter()
        self._settle_sharing()  # the last steps' updated values, for the patch
        hit = None
        # The first pending prefetch of these ids; those sent before it are
        # dropped. None matching: all stay (they are for later forwards:
        # a batch too large to prefetch comes between).
        at = next((i for i, p in enumerate(self._pending) if p.matches(flat)), None)
        if at is not None:
            # Out of the list before any answer is read: each is read once.
            before, hit = self._pending[:at], self._pending[at]
            del self._pending[:at + 1]
            for p in before:
                self._drop(p)
        if hit is None:
            uniq, inv = torch.unique(flat, return_inverse=True)
            self._keep_patches()  # the lookup writes the buffers the patches read
            rows = self.cache.lookup_unique(uniq, self._init_rows(uniq))
        else:
            uniq, inv = hit.uniq, hit.inv
            rows = torch.empty((uniq.numel(), self.dim), dtype=torch.float32, device=self.device)
            self._take(hit, rows)
            for upd_uniq, found, values, _ in hit.patches:
                n = _patch(rows, uniq, upd_uniq, found, values)
                if n is not None:
                    self._patched.append(n)
            if len(self._patched) >= 1024:  # folded on the device: no wait
                self._patched = [torch.stack(self._patched).sum()]
        self.timings["lookup"] += time.perf_counter() - t0
        return uniq, inv, rows

    def _keep_patches(self) -> None:
        """Copies the updated rows that pending prefetches (of every module
        of this table) would patch from this module's cache buffers: a step's
        outputs are views of them (:meth:`EmbeddingCache.step_views`), and
        the cache's next request, a step or a lookup, writes them. (A lookup
        that overwrote them gave a later prefetched forward another id's
        row: found by an independent tester over shm.)"""
        c = self.cache
        for m in self._members():
            for p in m._pending:
                p.patches = [(u, f.clone(), v.clone(), None) if owner is c else (u, f, v, owner)
                             for u, f, v, owner in p.patches]

    def _drop_table_lookups(self) -> List[tuple]:
        """Drops the lookups sent ahead by every module of this table that
        no later step can patch: those of dedupe "table" (a step with SUM
        answers no rows). Returns them, ``(module, lookup)``, for a step to
        send again after itself."""
        dropped = []
        for m in self._members():
            pending, m._pos_pending = m._pos_pending, []
            for p in pending:
                if self._drop_of(m, p):
                    dropped.append((m, p))
        return dropped

    def _drop_of(self, m: "_Sparse", p: _Prefetched) -> bool:
        """Drops module ``m``'s lookup ``p``; False when the daemon refused
        it, or when ``m`` is on another client whose connection turned out
        lost here (it then leaves the table's modules: :meth:`_members`)."""
        try:
            return m._drop(p)
        except ConnectionLost:
            if m.client is self.client:
                raise
            return False

    def _positions(self, flat: torch.Tensor) -> torch.Tensor:
        """dedupe "table": the ``(n, dim)`` rows of ``flat``'s positions, from
        the lookup sent after the last step when it was for these ids, else
        looked up now (find_or_insert of every position)."""
        t0 = time.perf_counter()
        self._settle_sharing()
        rows = torch.empty((flat.numel(), self.dim), dtype=torch.float32, device=self.device)
        at = next((i for i, p in enumerate(self._pos_pending) if p.matches(flat)), None)
        if at is not None:
            before, hit = self._pos_pending[:at], self._pos_pending[at]
            del self._pos_pending[:at + 1]
            for p in before:
                self._drop(p)
            self._take(hit, rows)
        else:
            self._keep_patches()  # the lookup writes the buffers the patches read
            c = self.cache
            c._recv(c._send(region.OP_FIND_OR_INSERT, flat, self._init_rows(flat)), rows)
        self.timings["lookup"] += time.perf_counter() - t0
        return rows

    def _apply_positions(self, flat: torch.Tensor, grads: torch.Tensor) -> None:
        """dedupe "table": the step of every position's gradient, summed per
        id by the table (apply_gradients with SUM), sent without waiting;
        then the lookup of the ids prefetch() was given, ordered after the
        step (its request first reads the step's answer, and its stream
        waits for the step's writes)."""
        t0 = time.perf_counter()
        again, hyper = self._begin_step(drop_pending=True)
        c = self.cache
        g = grads.detach().to(device=self.device, dtype=torch.float32)

        def step():
            self._missing += c._step_chunk(flat, g, hyper, None, None, wait=False, sum=True)

        self._step_then_lookups(again, step, ordered=True)
        self.timings["apply"] += time.perf_counter() - t0

    def _begin_step(self, drop_pending: bool = False):
        """What a step of either deduplication begins with: the steps in
        flight of this table's modules answered (their writes come first;
        steps sent by modules on other connections run in backward order),
        the lookups that modules of this table sent ahead with dedupe
        "table" dropped (this step makes them stale and answers no rows to
        patch them), with ``drop_pending`` those of dedupe "module" too (a
        step of dedupe "table" answers no rows to patch them either: their
        forwards look up again), then the step counted: whatever raises
        before leaves it uncounted (:meth:`_step_sent` uncounts one that
        raises after). Returns the lookups of dedupe "table" that are to be
        sent again after the step (of modules on this module's device and
        transport; the others' forwards look up) and the step's
        hyperparameters."""
        # Values set on the module since it was made: one that is no
        # number raises here, before anything is read or counted.
        hyper = dict(lr=_number(self.lr, "lr"), eps=_number(self.eps, "eps"), beta1=_number(self.betas[0], "betas[0]"),
                     beta2=_number(self.betas[1], "betas[1]"), weight_decay=_number(self.weight_decay, "weight_decay"))
        # A forward before the table was made again, its backward after:
        # no step for the new table's rows.
        self._refuse_if_remade()
        self._settle_sharing()
        again = [(m, p) for m, p in self._drop_table_lookups()
                 if m.device == self.device and m.cache.transport == self.cache.transport]
        if drop_pending:
            for m in self._members():
                pending, m._pending = m._pending, []
                for p in pending:
                    self._drop_of(m, p)
        self.step += 1
        hyper["step"] = self.step
        self._keep_patches()  # the step writes the buffers the patches read
        return again, hyper

    def _step_then_lookups(self, again: List[tuple], step: Callable[[], None], ordered: bool) -> None:
        """Runs ``step``, which sends this module's step (one that raises is
        not counted: :meth:`_step_sent`), then sends the lookups ``again``
        (``(module, lookup)``) and that of the ids prefetch() gave this
        module, each on a spare cache of its module. ``ordered`` on
        cuda-ipc with events: the lookups follow the step in the daemon,
        their inputs written before the step's wait event, their requests
        waiting for the step's done event, the step's answer not read
        first; elsewhere each lookup's request reads it first."""
        nxt, self._pos_next = self._pos_next, None
        if nxt is not None:
            again = again + [(self, nxt)]
        c = self.cache
        # This client's lookups first: a lookup on another client's
        # connection follows the step only once the step is answered.
        again = sorted(again, key=lambda mp: mp[0].client is not self.client)
        for m, p in again:
            p.cache = m._spare_cache()
        after = ordered and c.transport == "cuda-ipc" and c.events
        sent = 0
        try:
            if after:
                for m, p in again:
                    if m.client is self.client:
                        p.cache._settle_own()
                        p.cache._fill(p.ids, m._init_rows(p.ids))
            self._step_sent(step)
            for m, p in again:
                behind = after and m.client is self.client
                if m.client is not self.client:
                    c.settle()  # the step answered (on cuda-ipc: the stream follows its writes)
                if not behind:
                    # The step's answer read here, outside the lookup's
                    # try below: the step's refusal is the backward's
                    # error, not the lookup's.
                    m.client._settle()
                try:
                    init = None if behind else m._init_rows(p.ids)
                    p.token = p.cache._send(region.OP_FIND_OR_INSERT, p.ids, init, done_event=False,
                                            after=c._done if behind else None)
                except ConnectionLost:
                    # Another client's connection lost: that module is
                    # done (:meth:`_members`), this step stands.
                    if m.client is self.client:
                        raise
                    m._spare.append(p.cache)
                    sent += 1
                    continue
                except (HkvdError, ValueError, TypeError):
                    # A lookup that cannot go out (its init refused, the
                    # table gone) is not prefetched: the step was sent and
                    # stands, and the forward that looks the ids up says
                    # what is wrong.
                    m._spare.append(p.cache)
                    sent += 1
                    continue
                m._pos_pending.append(p)
                sent += 1
            for m in {id(m): m for m, _ in again}.values():
                while len(m._pos_pending) > 2:  # unused ones: at most two kept
                    m._drop(m._pos_pending.pop(0))
        except BaseException:
            for m, p in again[sent:]:
                m._spare.append(p.cache)
            raise

    # ---- the step -----------------------------------------------------
    def _grad_rows(self, n: int, device) -> torch.Tensor:
        """Zeroed ``(n, dim)`` rows for a step's summed gradients: the
        cache's own gradient buffer when the step goes there whole (no copy
        into it later), else a new tensor."""
        c = self.cache
        if c.transport == "cuda-ipc" and n <= c.max_batch and torch.device(device) == c.device:
            c._settle_own()  # the buffer may still be the last step's
            return c._grads[:n].zero_()
        return torch.zeros((n, self.dim), dtype=torch.float32, device=device)

    def _apply_step(self, uniq: torch.Tensor, grads: torch.Tensor) -> None:
        t0 = time.perf_counter()
        # The steps in flight answered first: their updated rows are in the
        # buffers before a patch copies them out (this module stepped twice
        # in one backward: two forwards).
        again, hyper = self._begin_step()
        # Updated rows are needed to patch the prefetches pending, this
        # module's and those of other modules of the table.
        # (Modules on another device are left out: their rows live there.)
        pending = [p for m in self._members() if m.device == self.device for p in m._pending]
        want = bool(pending)
        c = self.cache

        def step():
            if want and c.transport != "socket" and uniq.numel() <= c.max_batch:
                found, values = c.step_views(uniq, grads, **hyper)
                for p in pending:
                    p.patches.append((uniq, found, values, c))
            elif want:
                missing, found, values = c.optimizer_step(uniq, grads, values=True, wait=False, **hyper)
                for p in pending:
                    p.patches.append((uniq, found, values, None))
                self._missing += missing
            else:
                self._missing += self.cache.optimizer_step(uniq, grads, wait=False, **hyper)

        self._step_then_lookups(again, step, ordered=False)
        self.timings["apply"] += time.perf_counter() - t0

    def _refuse_if_remade(self) -> None:
        """Raises the error that said the table was made again under this
        module, again: every forward, step and prefetch after it says so (a
        second one failed on the old width's buffers, or ran on the new
        table's rows as the old one's). Where this module's own client
        dropped or created the table since the module was made, says so
        first: the daemon refuses that only on other connections
        (PROTOCOL.md, "A table made again"), and a new table of rows as
        wide (adagrad dim 4, then sgd dim 8) was read by a tester's forward
        as the old one's."""
        if self._remade is None and self.client._made.get(self.table, 0) != self.cache._made_at:
            self._remade = self._made_again_here()
        if self._remade is not None:
            raise type(self._remade)(self._remade.code, self._remade.message)

    def _made_again_here(self) -> HkvdError:
        """The error of a table this module's client dropped (and perhaps
        created again) since the module was made: ``WrongDim`` naming the
        new dim and optimizer where they differ (as :meth:`_dim_changed`),
        else ``UnknownTable``."""
        now = next((t["spec"] for t in self.client.tables() if t["spec"]["name"] == self.table), None)
        if now is None:
            return UnknownTable("unknown_table", f"table {self.table!r} was dropped by this module's client since "
                                                 f"this module was made for it: make a new module for a table "
                                                 f"created again")
        if (now["dim"], now.get("optimizer")) != (self.dim, self.optimizer):
            return WrongDim("wrong_dim", f"table {self.table!r} now has dim {now['dim']} and optimizer "
                                         f"{now.get('optimizer')}, not the dim {self.dim} and {self.optimizer} this "
                                         f"module was made for: this module's client dropped and created it again. "
                                         f"Make a new module for it")
        return UnknownTable("unknown_table", f"table {self.table!r} was dropped and created again since this module "
                                             f"was made for it (by this module's client): make a new module for it")

    @_in_turn
    def _gathered(self, ids):
        self._refuse_if_remade()
        known = self.client._dims.get(self.table, self.cache.row_dim)
        if known != self.cache.row_dim:
            # This module's client made the table again (and learned its
            # width): said here, not as a buffer's shape at the request.
            raise self._dim_changed(WrongDim("wrong_dim", f"rows of {known} floats, this module's hold "
                                                          f"{self.cache.row_dim}"))
        flat = self._flat(ids)
        if self.dedupe == "table" and 0 < flat.numel() <= self.cache.max_batch:
            try:
                rows = self._positions(flat)
            except WrongDim as e:
                raise self._dim_changed(e) from e
            except UnknownTable as e:
                raise self._made_again(e) from e
            except ReservedKey as e:
                raise self._reserved_at(e, flat, _unsigned(ids)) from e
            return _Positions.apply(self._anchor, rows, flat, self)
        try:
            uniq, inv, rows = self._lookup(flat)
        except WrongDim as e:
            raise self._dim_changed(e) from e
        except UnknownTable as e:
            raise self._made_again(e) from e
        except ReservedKey as e:
            raise self._reserved_at(e, flat, _unsigned(ids)) from e
        return _Gather.apply(self._anchor, rows, inv, uniq, self)

    @contextlib.contextmanager
    def _remade_named(self):
        """A step's ``WrongDim`` read inside (the backward, :meth:`flush`)
        raised as :meth:`_dim_changed` makes it: saying the table was made
        again under the module when it was."""
        try:
            yield
        except WrongDim as e:
            raise self._dim_changed(e) from e
        except UnknownTable as e:
            raise self._made_again(e) from e

    def _made_again(self, e: "UnknownTable") -> "HkvdError":
        """``e``, or, where the daemon says the table was dropped and
        created again since this module's connection used it (it refuses
        that once; the table may be as wide as the old one, whose rows
        this module would read as its own), the error every later forward
        raises too."""
        if self._remade is not None:
            return self._said(e)
        if _MADE_AGAIN not in e.message:
            return e
        self._remade = UnknownTable(e.code, f"table {self.table!r} was dropped and created again since this module "
                                            f"was made for it: make a new module for it (the daemon said: "
                                            f"{e.message})")
        return self._remade

    def _said(self, e: HkvdError) -> HkvdError:
        """``e`` when it is the error that said the table was made again
        under this module (raised by :meth:`_refuse_if_remade`), else that
        error: what was said once is said again, not wrapped."""
        if type(e) is type(self._remade) and e.message == self._remade.message:
            return e
        return type(self._remade)(self._remade.code, self._remade.message)

    def _dim_changed(self, e: "WrongDim") -> "WrongDim":
        """``e`` with what a user can act on when the table is not the one
        this module was made for any more (dropped and created again with
        another dim or optimizer): the daemon's message names row widths."""
        if self._remade is not None:
            return self._said(e)
        now = next((t for t in self.client.tables() if t["spec"]["name"] == self.table), None)
        if now is None:
            return e
        self.client._learn(now)  # the client's cached width is the old table's
        spec = now["spec"]
        if (spec["dim"], spec.get("optimizer")) == (self.dim, self.optimizer):
            return e
        self._remade = WrongDim(e.code, f"table {self.table!r} now has dim {spec['dim']} and optimizer "
                                        f"{spec.get('optimizer')}, not the dim {self.dim} and {self.optimizer} this "
                                        f"module was made for: was it dropped and created again? Make a new module "
                                        f"for it (the daemon said: {e.message})")
        return self._remade

    @staticmethod
    def _reserved_at(e: Optional["ReservedKey"], flat: torch.Tensor, unsigned: bool, where: str = "the ids",
                     then: str = "nothing was looked up") -> Optional["ReservedKey"]:
        """``e`` (None: the ids are checked here, before sending) naming
        the first reserved id's place in ``where`` (flattened), not in the
        distinct ids the daemon was sent: the reserved keys,
        0xfffffffffffffffc and up, are -4 to -1 as int64, and are named as
        the caller gave them (``unsigned``: uint64 ids, 2**64 - 1 and not
        -1). None when ``flat`` holds none."""
        at = ((flat >= -4) & (flat < 0)).nonzero()
        if at.numel() == 0:
            return e
        i = int(at[0, 0])
        sid = int(flat[i])
        uid = sid + (1 << 64)
        shown, span = (f"{uid}", f"{(1 << 64) - 4} to {(1 << 64) - 1}") if unsigned else (f"{sid}", "-4 to -1")
        if getattr(e, "prefetched", False):
            then += " (the lookup that prefetch() sent ahead for these ids was refused)"
        return ReservedKey(getattr(e, "code", "reserved_key"),
                           f"id {shown} ({uid:#x}) at index {i} of {where} (flattened) is reserved: ids {span} "
                           f"(0xfffffffffffffffc and up) mark empty slots in the table; {then}")

    def get_extra_state(self) -> dict:
        """What ``state_dict()`` keeps of the module: the optimizer's step
        count (Adam's bias correction follows it). The rows and their
        optimizer state are the table's (its checkpoints and exports)."""
        return {"step": self.step}

    def set_extra_state(self, state) -> None:
        """The step count of ``state`` (``get_extra_state``), checked as the
        wire checks ``step`` before it is kept: a count the next backward
        would send refused (-3, 2**64, a float) was accepted here, and that
        step then raised and still moved the count."""
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(state, dict) or isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"_extra_state must be a dict {{'step': int}} (get_extra_state's), not {state!r}")
        # The next step sends step + 1: at most 2**64 - 1.
        if not 0 <= int(step) < (1 << 64) - 1:
            raise ValueError(f"_extra_state['step'] must be 0 to {(1 << 64) - 2}, not {int(step)}")
        self.step = int(step)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        # A state_dict saved before the step count was kept has none: the
        # count stays where it is, as it did then.
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)

    @property
    def patched_rows(self) -> int:
        """Prefetched rows patched with a later step's updated values."""
        return int(torch.stack(self._patched).sum()) if self._patched else 0

    def extra_repr(self) -> str:
        return (f"table={self.table!r}, dim={self.dim}, optimizer={self.optimizer}, lr={self.lr}, "
                f"transport={self.cache.transport}")


def _patch(rows: torch.Tensor, uniq: torch.Tensor, upd: torch.Tensor, found: torch.Tensor,
           values: torch.Tensor):
    """rows[i] = values[j] where uniq[i] == upd[j] and found[j] (both
    sorted; ``found`` bool or uint8); returns how many rows were patched
    (a 0-d tensor; None when either side is empty). On a GPU nothing here waits for the device (no boolean
    indexing, whose size the host would have to read: a select of every
    row instead); on the CPU the indexing is the cheaper."""
    if upd.numel() == 0 or uniq.numel() == 0:
        return None
    j = torch.searchsorted(upd, uniq).clamp_(max=upd.numel() - 1)
    hit = (upd[j] == uniq).logical_and_(found[j])
    if rows.is_cuda:
        torch.where(hit.unsqueeze(1), values[j], rows, out=rows)
    else:
        rows[hit] = values[j[hit]]
    return hit.sum()


class Embedding(_Sparse):
    """``torch.nn.Embedding`` over an hkvd table created with an optimizer,
    the optimizer running in the table.

    ``forward(ids)`` (int64 ids of any shape, on any device) returns float32
    rows of shape ``ids.shape + (dim,)`` on ``device``. With ``dedupe``
    ``"table"`` (the default) every position's id goes to the table in one
    find_or_insert, which answers a row per position (unknown ids are
    inserted with ``init(ids)`` rows, a function of the ids returning
    ``(n, dim)``, zeros when None, and zero optimizer state); the backward
    sends every position's gradient in one apply_gradients request with
    SUM (the table sums a repeated id's gradients and steps it once). With
    ``"module"`` the ids are deduplicated on ``device`` (``torch.unique``),
    looked up once each and gathered, and the backward sums the gradient
    per distinct id on ``device`` before its apply_gradients request. The
    step carries ``lr``, ``eps``, ``betas``, ``weight_decay`` and the step
    count: after ``loss.backward()`` the table is updated, so no optimizer
    is needed for these rows (the module has no parameters). The backward
    of each forward is one optimizer step (Adam's step count advances with
    it).

    :meth:`prefetch` (``prefetch(next_ids)``) has the next step's lookup
    sent ahead: with ``"table"`` right behind this step's apply_gradients,
    with ``"module"`` at once (its rows patched after the step). Transports are EmbeddingCache's
    (``transport``, ``max_batch``, ``events``). ``timings`` sums the
    seconds spent in lookups and in apply_gradients; ``missing`` counts
    the ids whose row was gone when their step came (evicted meanwhile:
    their gradient was dropped).
    """

    def forward(self, ids) -> torch.Tensor:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else np.shape(ids)
        return self._gathered(ids).reshape(shape + (self.dim,))


class EmbeddingBag(_Sparse):
    """``torch.nn.EmbeddingBag`` over an hkvd table created with an
    optimizer (see :class:`Embedding` for the table, the step and
    prefetch): ``forward(input, offsets=None)`` pools the rows of each bag
    with ``mode`` ``sum`` or ``mean``: ``input`` 2-D ``(B, L)`` (bags of L
    ids, ``offsets`` None) or 1-D with ``offsets`` (B starts, as
    ``nn.EmbeddingBag``; ``include_last_offset`` as there). An empty bag
    gives zeros. ``per_sample_weights`` (mode ``sum`` only) scales each id's
    row. ``prefetch(next_input)`` takes the next step's ``input``."""

    def __init__(self, client: Client, table: str, mode: str = "mean", include_last_offset: bool = False, **kw):
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be sum or mean, not {mode!r}")
        super().__init__(client, table, **kw)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input, offsets=None, per_sample_weights=None) -> torch.Tensor:
        ids = input if isinstance(input, torch.Tensor) else torch.as_tensor(np.asarray(input))
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets go with 1-D input; 2-D input is one bag per row")
            b, L = ids.shape
            bag = torch.arange(b, device=self.device).repeat_interleave(L)
            counts = torch.full((b,), L, device=self.device, dtype=torch.int64)
        elif ids.dim() == 1:
            if offsets is None:
                raise ValueError("1-D input needs offsets (the start of each bag)")
            off = _offsets(offsets, ids.numel(), self.include_last_offset).to(device=self.device, dtype=torch.int64)
            if off.numel() == 0:
                return torch.zeros((0, self.dim), dtype=torch.float32, device=self.device)
            n = ids.numel()
            if self.include_last_offset:
                starts, ends = off[:-1], off[1:]
            else:
                starts, ends = off, torch.cat([off[1:], torch.tensor([n], device=self.device)])
            b = starts.numel()
            counts = ends - starts
            bag = torch.arange(b, device=self.device).repeat_interleave(counts)
        else:
            raise ValueError(f"input must be 1-D or 2-D, not {ids.dim()}-D")
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError("per_sample_weights need mode sum")
            if tuple(per_sample_weights.shape) != tuple(ids.shape):
                raise ValueError(f"per_sample_weights must have the input's shape {tuple(ids.shape)}, "
                                 f"not {tuple(per_sample_weights.shape)}")
        # Checked before the lookup, which inserts the ids the table lacks.
        rows = self._gathered(ids)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.reshape(-1, 1).to(device=self.device, dtype=torch.float32)
        out = torch.zeros((b, self.dim), dtype=torch.float32, device=self.device).index_add(0, bag, rows)
        if self.mode == "mean":
            out = out / counts.clamp(min=1).to(torch.float32).unsqueeze(1)
        return out

    def prefetch(self, input) -> None:  # noqa: D102 - Embedding.prefetch, on the ids of the bags
        super().prefetch(input)


def _offsets(offsets, n: int, include_last: bool) -> torch.Tensor:
    """``offsets`` of a 1-D EmbeddingBag input of ``n`` ids, checked as
    ``nn.EmbeddingBag`` checks them: a 1-D integer tensor starting at 0,
    not decreasing, none past ``n`` (with ``include_last``, the last is
    ``n``). The values are read only where they are on the CPU: on a GPU
    that would make the host wait for the device every step."""
    off = _integer_ids(offsets if isinstance(offsets, torch.Tensor) else torch.as_tensor(np.asarray(offsets)),
                       "offsets")
    if off.dim() != 1:
        raise ValueError(f"offsets must be a 1-D tensor, not of shape {tuple(off.shape)}")
    if off.numel() == 0:
        if include_last:
            raise ValueError("with include_last_offset, offsets hold at least one value (the end of the ids)")
        return off  # no bags, as nn.EmbeddingBag (the ids are not looked up)
    if not off.is_cuda:
        o = off.to(torch.int64)
        if int(o[0]) != 0:
            raise ValueError(f"offsets[0] must be 0 (the first bag starts at the first id), not {int(o[0])}")
        if bool((o[1:] < o[:-1]).any()):
            raise ValueError("offsets must not decrease")
        if int(o[-1]) > n or (include_last and int(o[-1]) != n):
            want = f"= {n}" if include_last else f"<= {n}"
            raise ValueError(f"offsets' last value must be {want} (the number of ids), not {int(o[-1])}")
    return off


def _batch_ids(batch):
    """A batch's ids as :class:`Prefetcher` takes them by default: the
    batch itself when it is a tensor, else its first element."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        raise TypeError("Prefetcher(loader, module) takes a batch's ids as batch[0], and this batch is a dict: "
                        "say where its ids are, e.g. Prefetcher(loader, [(module, lambda b: b['ids'])])")
    return batch[0]


class Prefetcher:
    """Iterates ``loader`` one batch ahead: before batch t is yielded, the
    lookup of batch t + 1's ids is sent (``module.prefetch(ids(batch))``
    for each ``(module, ids)`` pair), so the forward of step t + 1 finds its
    rows fetched while step t computed. ``ids`` picks the ids a module takes
    from a batch (default: a tensor batch itself, else the batch's first
    element; a dict batch needs ``ids``)::

        for x, y in hkvd.torch.Prefetcher(loader, [(emb, lambda b: b[0])]):
            loss = loss_fn(model(x), y)
            loss.backward()        # the table is updated here
    """

    def __init__(self, loader: Iterable, modules):
        if isinstance(modules, _Sparse):
            modules = [(modules, _batch_ids)]
        self.loader = loader
        self.modules = [(m, f) for m, f in modules]

    def _prefetch(self, batch) -> None:
        for m, f in self.modules:
            m.prefetch(f(batch))

    def __iter__(self):
        it = iter(self.loader)
        try:
            cur = next(it)
        except StopIteration:
            return
        self._prefetch(cur)
        for nxt in it:
            self._prefetch(nxt)
            yield cur
            cur = nxt
        yield cur

    def __len__(self) -> int:
        return len(self.loader)
