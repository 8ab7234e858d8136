"""Region requests (``proto/PROTOCOL.md``, "Region requests"): one builder
for arrays that lie either in ``hkvd.shm_array`` memory (memfd regions) or
in CUDA memory (device regions, :mod:`hkvd.cuda`).

Each array of a request is resolved to a :class:`Ref` (region id, byte
offset, element count; the region is registered on the connection the
first time), checked against the op's slots (dtype, count, contiguity,
all arrays in one kind of memory), and the request is sent as ``table``,
one 20-byte reference per array and, with the ``EVENTS`` flag, ``u32
wait_event``, ``u32 done_event``. The socket carries only that and a small
answer.
"""

from __future__ import annotations

import socket as _socket
import struct
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import cuda as _cuda

F_SCORES = 0x0002
F_OUTCOMES = 0x0004
F_REGION = 0x0010
F_EVENTS = 0x0020
# apply_gradients: repeated keys' gradients summed, one step per key.
F_SUM = 0x0040
OP_UNREGISTER = 0x41

OP_FIND = 0x10
OP_CONTAINS = 0x11
OP_INSERT_OR_ASSIGN = 0x12
OP_INSERT_AND_EVICT = 0x13
OP_FIND_OR_INSERT = 0x14
OP_ASSIGN = 0x15
OP_ACCUM_OR_ASSIGN = 0x17
OP_ERASE = 0x18
OP_EXPORT = 0x1B
OP_LOAD = 0x1C
OP_APPLY_GRADIENTS = 0x1F

_REF = struct.Struct("<IQQ")
_HEADER = struct.Struct("<4sBBHQI")


class Slot(NamedTuple):
    """One array of a region request: its name, element type (``u64``,
    ``u8``, ``f32``), count rule (``n``: sets n; ``N``: n; ``ND``: n × dim;
    ``NV``: n × the table's value dim, without optimizer state;
    ``C``: the output capacity c ≥ n, set by the first such array; ``CD``: c × dim)
    and whether the daemon writes it (``out``)."""

    name: str
    elem: str
    count: str
    out: bool = False


def slots(op: int, scores: bool = False, outcomes: bool = False) -> List[Slot]:
    """The arrays a region request of ``op`` names, in body order (the
    keyed ops; PROTOCOL.md's table)."""
    keys = Slot("keys", "u64", "n")
    if op == OP_FIND:
        s = [keys, Slot("found", "u8", "N", True), Slot("values", "f32", "ND", True)]
        return s + ([Slot("scores", "u64", "N", True)] if scores else [])
    if op == OP_CONTAINS:
        return [keys, Slot("found", "u8", "N", True)]
    if op == OP_EXPORT:
        return [Slot("keys", "u64", "C", True), Slot("values", "f32", "CD", True), Slot("scores", "u64", "C", True)]
    if op == OP_ERASE:
        return [keys] + ([Slot("erased", "u8", "N", True)] if outcomes else [])
    if op == OP_APPLY_GRADIENTS:
        s = [keys, Slot("grads", "f32", "NV")]
        return s + ([Slot("found", "u8", "N", True), Slot("values", "f32", "NV", True)] if outcomes else [])
    if op in (OP_INSERT_OR_ASSIGN, OP_INSERT_AND_EVICT, OP_FIND_OR_INSERT, OP_ASSIGN, OP_ACCUM_OR_ASSIGN, OP_LOAD):
        # find_or_insert's values are read (the rows to insert) and written (the rows found).
        s = [keys, Slot("deltas" if op == OP_ACCUM_OR_ASSIGN else "values", "f32", "ND", op == OP_FIND_OR_INSERT)]
        if scores:
            s.append(Slot("scores", "u64", "N"))
        if outcomes and op != OP_LOAD:
            s.append(Slot("outcomes", "u8", "N", True))
        if op == OP_INSERT_AND_EVICT:
            s += [Slot("evicted_keys", "u64", "C", True), Slot("evicted_values", "f32", "CD", True),
                  Slot("evicted_scores", "u64", "C", True), Slot("evicted_kinds", "u8", "C", True)]
        return s
    raise ValueError(f"op 0x{op:02x} has no region form in this client")


_ELEM_DTYPES = {
    "u64": (np.dtype(np.uint64), np.dtype(np.int64)),
    "u8": (np.dtype(np.uint8), np.dtype(np.bool_)),
    "f32": (np.dtype(np.float32),),
}
_ELEM_WORDS = {"u64": "uint64 or int64", "u8": "uint8 or bool", "f32": "float32"}


class Ref:
    """An array in a registered region: ``region``, byte ``offset``,
    element ``count``, and what the checks need (shape, dtype, contiguity,
    ``where``: ``shm`` or ``cuda``, the device ordinal, the library)."""

    __slots__ = ("region", "offset", "count", "shape", "dtype", "where", "device", "lib", "contiguous")

    def __init__(self, region, offset, count, shape, dtype, where, device=-1, lib="numpy", contiguous=True):
        self.region, self.offset, self.count, self.shape, self.dtype = region, offset, count, shape, dtype
        self.where, self.device, self.lib, self.contiguous = where, device, lib, contiguous

    def head(self, rows: int) -> "Ref":
        """The first ``rows`` rows (elements of a 1-D array): a reference to
        a prefix of the same memory, without any driver call."""
        if not self.shape:
            raise ValueError("a 0-d array has no rows")
        if rows < 0 or rows > self.shape[0]:
            raise ValueError(f"{rows} rows asked of an array of {self.shape[0]}")
        per = 1
        for d in self.shape[1:]:  # a Python product: np.prod costs a few us a call
            per *= int(d)
        return Ref(self.region, self.offset, rows * per, (rows,) + tuple(self.shape[1:]), self.dtype,
                   self.where, self.device, self.lib, self.contiguous)

    def wire(self) -> Tuple[int, int, int]:
        return self.region, self.offset, self.count

    def __repr__(self) -> str:
        return f"Ref(region={self.region}, offset={self.offset}, count={self.count}, {self.where})"


# ---- wire ---------------------------------------------------------------

def _str(s: str) -> bytes:
    b = s.encode()
    if len(b) > 0xFFFF:
        raise ValueError(f"a table name must be at most 65535 bytes (UTF-8), not {len(b)}")
    return struct.pack("<H", len(b)) + b


def encode_body(table: str, refs: Sequence[Tuple[int, int, int]], events: Optional[Tuple[int, int]] = None,
                head: bytes = b"") -> bytes:
    """A region request's body: ``table``, the 20-byte references, and with
    ``events`` the ``u32 wait_event``, ``u32 done_event`` trailer."""
    b = _str(table) + head + b"".join(_REF.pack(*r) for r in refs)
    if events is not None:
        b += struct.pack("<II", *events)
    return b


def request_flags(scores: bool = False, outcomes: bool = False, events: bool = False) -> int:
    return F_REGION | (F_SCORES if scores else 0) | (F_OUTCOMES if outcomes else 0) | (F_EVENTS if events else 0)


def encode_request(op: int, rid: int, table: str, refs: Sequence[Tuple[int, int, int]], scores: bool = False,
                   outcomes: bool = False, events: Optional[Tuple[int, int]] = None) -> bytes:
    """The whole frame of a region request (what :func:`call` sends)."""
    body = encode_body(table, refs, events)
    return _HEADER.pack(b"HKVD", 1, op, request_flags(scores, outcomes, events is not None), rid, len(body)) + body


def raw_call(client, op: int, body: bytes, flags: int = 0) -> bytes:
    """Sends one request and returns its answer body unparsed (raises the
    daemon's error)."""
    client._here()  # before the lock, which a parent's thread may hold in a forked child
    client._settle()  # not under _io (Client._send)
    with client._io:  # flagged before another thread can read the answer
        rid = client._send(op, flags, [body], settle=False)
        client._pending[rid].flags |= F_REGION  # the answer is returned as bytes
    return client.result(rid)


# ---- resolving arrays ---------------------------------------------------

class _CudaRegion(NamedTuple):
    id: int
    base: int
    size: int
    device: int


def ref(client, a, name: str = "array") -> Ref:
    """The reference to ``a`` (an ``hkvd.shm_array`` or a view of one, a
    CUDA array, a torch tensor on either), registering its memory on
    ``client`` the first time."""
    client._here()  # in a forked child, before any CUDA or memfd work
    if isinstance(a, Ref):
        return a
    if isinstance(a, np.ndarray):
        return _shm_ref(client, a, name)
    dev = _cuda.describe(a)
    if dev is not None:
        return _cuda_ref(client, dev, name)
    if _cuda._is_torch(a):  # a CPU tensor: its numpy view may be an shm array
        return _shm_ref(client, a.detach().numpy(), name)
    raise TypeError(
        f"{name} ({type(a).__name__}) is neither an hkvd.shm_array nor CUDA memory: region requests take arrays "
        "made with hkvd.shm_array(shape, dtype), or objects with __cuda_array_interface__ (CuPy, PyTorch CUDA "
        "tensors); other arrays go through the socket (find, insert_or_assign, ...)")


def _shm_ref(client, a: np.ndarray, name: str) -> Ref:
    from . import shm as _shm

    try:
        m, offset = _shm._memfd_of(a)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    regions = client.__dict__.setdefault("_regions", {})
    if m.serial not in regions:
        regions[m.serial] = _shm.register_memfd(client, m.fd, m.size)
        _shm._CLIENTS.add(client)
    return Ref(regions[m.serial], offset, a.size, a.shape, a.dtype, "shm", -1, "numpy", a.flags.c_contiguous)


def _cuda_ref(client, dev: "_cuda.DeviceArray", name: str) -> Ref:
    if dev.nbytes == 0:
        return Ref(0, 0, 0, dev.shape, dev.dtype, "cuda", dev.device, dev.lib, True)
    mtype, buf, ordinal = _cuda.pointer_info(dev.ptr)
    if mtype == 0:
        raise ValueError(f"{name}: address 0x{dev.ptr:x} is not memory CUDA knows in this process (freed?)")
    if mtype == _cuda.CU_MEMORYTYPE_HOST:
        raise ValueError(f"{name}: address 0x{dev.ptr:x} is page-locked host memory, not device memory: "
                         "put host arrays in hkvd.shm_array memory")
    regions: Dict[int, _CudaRegion] = client.__dict__.setdefault("_cuda_regions", {})
    reg = regions.get(buf)
    if reg is None:
        reg = _register_allocation(client, dev.ptr, ordinal, buf)
    offset = dev.ptr - reg.base
    if offset < 0 or offset + dev.nbytes > reg.size:
        raise ValueError(f"{name}: bytes 0x{dev.ptr:x}+{dev.nbytes} are not inside their allocation "
                         f"0x{reg.base:x}+{reg.size}")
    return Ref(reg.id, offset, dev.size, dev.shape, dev.dtype, "cuda", ordinal, dev.lib, dev.contiguous)


def _register_allocation(client, ptr: int, ordinal: int, buf: int) -> _CudaRegion:
    from . import ConnectionLost, HkvdError

    _drop_stale(client)
    base, size, handle = _cuda.allocation(ptr, ordinal)
    uuid = _cuda.device_uuid(ordinal)
    try:
        body = raw_call(client, _cuda.OP_REGISTER_CUDA, _cuda.register_body(uuid, handle, size))
    except ConnectionLost:
        raise
    except HkvdError as e:
        raise _cuda.CudaIpcUnavailable(
            "daemon", f"the daemon refused register_cuda of GPU {ordinal} ({e.code}: {e.message})", e.code) from e
    region, _ = struct.unpack("<IQ", body)
    reg = _CudaRegion(region, base, size, ordinal)
    client._cuda_regions[buf] = reg
    return reg


def _drop_stale(client) -> None:
    """Unregisters the device regions whose allocation was freed (its
    buffer id is gone), so a process that frees and allocates keeps no
    dead registrations."""
    from . import HkvdError

    regions: Dict[int, _CudaRegion] = client.__dict__.setdefault("_cuda_regions", {})
    for buf, reg in list(regions.items()):
        _, now, _ = _cuda.pointer_info(reg.base)
        if now != buf:
            del regions[buf]
            try:
                client._call(OP_UNREGISTER, F_REGION, [struct.pack("<I", reg.id)])
            except HkvdError:
                pass


def cuda_event(client, device: int) -> "_cuda.CudaEvent":
    """A new interprocess event on GPU ``device``, registered on ``client``."""
    from . import ConnectionLost, HkvdError

    ev = _cuda.CudaEvent(device)
    try:
        body = raw_call(client, _cuda.OP_REGISTER_CUDA_EVENT, _cuda.register_body(ev.uuid, ev.handle, None))
    except HkvdError as e:
        ev.destroy()
        if isinstance(e, ConnectionLost):
            raise
        raise _cuda.CudaIpcUnavailable(
            "daemon", f"the daemon refused register_cuda_event of GPU {device} ({e.code}: {e.message})", e.code) from e
    ev.id = struct.unpack("<I", body)[0]
    client.__dict__.setdefault("_events", []).append(ev)
    return ev


def _own_events(client, device: int) -> Tuple["_cuda.CudaEvent", "_cuda.CudaEvent"]:
    """The client's (wait, done) events of ``device``, made on first use."""
    evs = client.__dict__.setdefault("_own_events", {})
    if device not in evs:
        evs[device] = (cuda_event(client, device), cuda_event(client, device))
    return evs[device]


# ---- checks and the call ------------------------------------------------

def check(refs: Sequence[Ref], sl: Sequence[Slot], dim: Optional[int], vdim: Optional[int] = None) -> int:
    """Checks dtypes, counts, contiguity and placement; returns n (``vdim``:
    the table's value dim, for ``NV`` slots)."""
    n = refs[0].count
    cap = next((r.count for r, s in zip(refs, sl) if s.count == "C"), None)
    if cap is not None and cap < n:
        raise ValueError(f"the evicted arrays have room for {cap} entries; insert_and_evict of {n} keys needs {n}")
    for r, s in zip(refs, sl):
        if s.count == "C" and r.count != cap:
            raise ValueError(f"{s.name} has {r.count} elements, {cap} are needed (as evicted_keys)")
        if s.count == "CD" and (r.count != cap * dim or len(r.shape) > 2):
            raise ValueError(f"{s.name} must be float32 of shape ({cap}, {dim}), not of shape {tuple(r.shape)}")
        if r.dtype is None or np.dtype(r.dtype) not in _ELEM_DTYPES[s.elem]:
            raise TypeError(f"{s.name} must be {_ELEM_WORDS[s.elem]}, found {r.dtype}")
        if not r.contiguous:
            raise ValueError(f"{s.name} must be C-contiguous (copy it into a contiguous buffer first)")
        if s.count == "N" and r.count != n:
            raise ValueError(f"{s.name} has {r.count} elements, {n} are needed (one per key)")
        if s.count == "NV":
            if r.count != n * vdim or (len(r.shape) == 2 and tuple(r.shape) != (n, vdim)) or len(r.shape) > 2:
                raise ValueError(f"{s.name} must be float32 of shape ({n}, {vdim}) ({n} keys, value dim {vdim}), "
                                 f"not of shape {tuple(r.shape)}")
        if s.count == "ND":
            if r.count != n * dim or (len(r.shape) == 2 and tuple(r.shape) != (n, dim)) or len(r.shape) > 2:
                raise ValueError(f"{s.name} must be float32 of shape ({n}, {dim}) ({n} keys, dim {dim}), "
                                 f"not of shape {tuple(r.shape)}")
    if n:
        first = refs[0]
        for r, s in zip(refs[1:], sl[1:]):
            if r.where != first.where:
                raise ValueError(f"arrays of one request lie all in hkvd.shm_array memory or all in CUDA memory: "
                                 f"{sl[0].name} is in {first.where} memory, {s.name} in {r.where} memory")
            if r.where == "cuda" and r.device != first.device:
                raise ValueError(f"arrays of one request lie on one GPU: {sl[0].name} is on GPU {first.device}, "
                                 f"{s.name} on GPU {r.device}")
    return n


# A count the daemon answers when it answered before the kernels ran (a done
# event on the GPU path): not counted.
NOT_COUNTED = (1 << 64) - 1


def count(body: Optional[bytes]) -> Optional[int]:
    """The u64 count of an answer body: 0 for no request, None when the
    daemon answered before counting (``done`` event on the GPU path)."""
    if body is None:
        return 0
    v = struct.unpack("<Q", body)[0]
    return None if v == NOT_COUNTED else v


def call(client, op: int, table: str, arrays: Sequence, scores: bool = False, outcomes: bool = False,
         stream=None, wait=True, done=False, head: bytes = b"", flags: int = 0) -> Optional[bytes]:
    """Sends a region request naming ``arrays`` (in the op's slot order) and
    returns the answer body, or None when there are no keys (nothing sent).

    For CUDA arrays, ``stream`` is the stream the request follows (default:
    the current stream of torch / cupy on the arrays' device; else the
    legacy default stream), and:

    - ``wait``: True, the client records its wait event on ``stream`` and
      the daemon's stream waits for it before reading (no host round
      trip); a :class:`hkvd.cuda.CudaEvent` of this client: that one is
      recorded and waited for; False: ``stream`` is synchronized on the
      host before sending; None: nothing (the caller guarantees the inputs
      are written).
    - ``done``: True, the daemon records the client's done event after its
      last write and ``stream`` waits for it once the answer is read, so
      work queued on ``stream`` afterwards sees the outputs; where the
      request runs on the GPU in place (one shard), the daemon answers as
      soon as its kernels are queued, before they ran, and the counts of the
      answer are ``NOT_COUNTED`` (the methods return None); a write so
      answered that turns out to hold a reserved key writes nothing, and
      its ``reserved_key`` error is raised by a later request of this
      client, which the daemon did not run (PROTOCOL.md); a CudaEvent:
      the daemon records that one and the caller waits for it (say with
      ``event.wait(stream)``); False or None (default): no event (the
      outputs are complete, and counted, when the answer is read).

    ``flags``: further flag bits of the op (``F_SUM`` for apply_gradients).
    """
    f = _frame(client, op, table, arrays, scores, outcomes, stream, wait, done, head)
    if f is None:
        return None
    fl, body, post, h = f
    answer = client._call(op, fl | flags, [body])
    if post is not None:
        post.wait(h)
    return answer


class Pending(NamedTuple):
    """A region request sent and not yet answered (:func:`send`)."""

    rid: int
    post: Optional[object]
    stream: Optional[int]


def send(client, op: int, table: str, arrays: Sequence, scores: bool = False, outcomes: bool = False,
         stream=None, wait=True, done=False, head: bytes = b"", flags: int = 0) -> Optional[Pending]:
    """:func:`call`'s first half: checks and sends the request and returns
    at once (None when there are no keys: nothing sent); :func:`finish`
    reads its answer. Meanwhile the arrays belong to the daemon: the
    client neither writes the inputs nor reads the outputs, and other
    requests may go out on the connection (the daemon runs them
    concurrently, in no set order)."""
    f = _frame(client, op, table, arrays, scores, outcomes, stream, wait, done, head)
    if f is None:
        return None
    fl, body, post, h = f
    rid = client._send(op, fl | flags, [body], settle=not isinstance(wait, After))
    return Pending(rid, post, h if post is not None else None)


class After(NamedTuple):
    """``wait=After(event)`` (:func:`send`, CUDA arrays): the request waits
    for the daemon's record of ``event``, the done event of an earlier
    request of this client whose answer is not read yet (the daemon polls
    it once that request recorded it; PROTOCOL.md, "Events"). Nothing is
    recorded here and no answer is read first: the caller wrote the
    request's inputs before it sent that earlier request (whose own wait
    event covers them)."""

    event: object


def _frame(client, op, table, arrays, scores, outcomes, stream, wait, done, head):
    """The checked request of :func:`call` / :func:`send`: ``(flags, body,
    done event to wait for or None, stream)``, its events recorded; None
    when there are no keys."""
    client._here()  # in a forked child, before events are recorded
    if getattr(client, "_deferred", None) and not isinstance(wait, After):
        # Answers that must come first: read before this request's wait
        # event is recorded, so its stream follows their done events.
        client._settle()
    sl = slots(op, scores, outcomes)
    if len(arrays) != len(sl):
        raise TypeError(f"this request names {len(sl)} arrays ({', '.join(s.name for s in sl)}), "
                        f"{len(arrays)} were given")
    for a, s in zip(arrays, sl):
        # The daemon writes these through its own mapping: a read-only view
        # would be changed behind numpy's back.
        if s.out and isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"{s.name} is read-only (its writeable flag is off), and the daemon writes it")
    refs = [ref(client, a, s.name) for a, s in zip(arrays, sl)]
    dim = client.dim(table) if any(s.count in ("ND", "CD") for s in sl) else None
    vdim = client.value_dim(table) if any(s.count == "NV" for s in sl) else None
    n = check(refs, sl, dim, vdim)
    if n == 0:
        return None
    events = None
    post = None
    if refs[0].where == "cuda":
        device = refs[0].device
        h = _cuda.stream_handle(stream, refs[0].lib, device)
        w = d = 0
        if isinstance(wait, After):
            w = wait.event.id
        elif wait is True or isinstance(wait, _cuda.CudaEvent):
            ev = _own_events(client, device)[0] if wait is True else wait
            ev.record(h)
            w = ev.id
        elif wait is False:
            _cuda.synchronize(h, device)
        if done is True:
            post = _own_events(client, device)[1]
            d = post.id
        elif isinstance(done, _cuda.CudaEvent):
            d = done.id
        if w or d:
            events = (w, d)
    elif isinstance(wait, (_cuda.CudaEvent, After)) or isinstance(done, _cuda.CudaEvent):
        raise ValueError("events go with CUDA arrays; these arrays are in hkvd.shm_array memory")
    body = encode_body(table, [r.wire() for r in refs], events, head)
    return request_flags(scores, outcomes, events is not None), body, post, (h if post is not None else None)


def finish(client, p: Pending) -> bytes:
    """The answer body of a request :func:`send` sent (raises its error);
    with a done event, the stream it followed then waits for the outputs."""
    answer = client.result(p.rid)
    if p.post is not None:
        p.post.wait(p.stream)
    return answer


def release(client, timeout: float = 5.0) -> None:
    """Unregisters every region and event of ``client`` (pipelined; errors
    ignored: the daemon releases them anyway when the connection closes)
    and destroys the client's events."""
    from . import HkvdError, ProtocolError

    ids = list(client.__dict__.get("_regions", {}).values())
    ids += [r.id for r in client.__dict__.get("_cuda_regions", {}).values()]
    events = client.__dict__.get("_events", [])
    ids += [e.id for e in events if e.id]
    client.__dict__.get("_regions", {}).clear()
    client.__dict__.get("_cuda_regions", {}).clear()
    client.__dict__.get("_own_events", {}).clear()
    client.__dict__["_events"] = []
    try:
        if ids and client._sock.fileno() >= 0:
            client._sock.settimeout(timeout)
            rids = [client._send(OP_UNREGISTER, F_REGION, [struct.pack("<I", i)]) for i in ids]
            for rid in rids:
                try:
                    client.result(rid)
                except HkvdError:
                    pass
    except (OSError, ProtocolError, _socket.timeout):
        pass
    finally:
        for e in events:
            try:
                e.destroy()
            except Exception:  # noqa: BLE001 - closing: a failed destroy leaks one event, nothing more
                pass
