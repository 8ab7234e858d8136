"""Python client of hkvd, the embedding-cache daemon.

Speaks the daemon's wire protocol (``proto/PROTOCOL.md``) over a Unix socket:
20-byte little-endian frame headers, bulk arrays as raw little-endian bytes.
Requests are sent with ``sendmsg`` straight from the numpy buffers; answers
are received with ``recv_into`` straight into preallocated numpy arrays, so
no Python loop ever touches a key.
"""

from __future__ import annotations

import json
import math
import operator
import os
import socket as _socket
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import region as _region
from . import shm as _shm
from .cuda import CudaError, CudaEvent, CudaIpcUnavailable
from .region import Ref
from .shm import shm_array

__all__ = [
    "Client",
    "Summary",
    "Evicted",
    "HkvdError",
    "BadMagic",
    "BadVersion",
    "Oversized",
    "Truncated",
    "UnknownOp",
    "UnknownTable",
    "WrongDim",
    "LengthMismatch",
    "ReservedKey",
    "BadRequest",
    "ScoresError",
    "TableExists",
    "Forbidden",
    "Busy",
    "ShuttingDown",
    "ResourceExhausted",
    "NotFound",
    "Timeout",
    "CorruptCheckpoint",
    "BackingUnavailable",
    "ConnectionLost",
    "WrongProcess",
    "InternalError",
    "ProtocolError",
    "CudaIpcUnavailable",
    "CudaError",
    "CudaEvent",
    "Ref",
    "OPTIMIZERS",
    "BACKING_MODES",
    "default_socket",
    "ORIGIN_HIT",
    "ORIGIN_FILLED",
    "ORIGIN_ABSENT",
    "ORIGIN_LATE",
    "shm_array",
]

MAGIC = b"HKVD"
VERSION = 1
HEADER = struct.Struct("<4sBBHQI")

F_RESPONSE, F_SCORES, F_OUTCOMES, F_ERROR = 0x1, 0x2, 0x4, 0x8
F_SUM = 0x40  # apply_gradients: repeated keys' gradients summed, one step per key
# Per-key origins of a backed table's find / contains (find_with_origins).
ORIGIN_HIT, ORIGIN_FILLED, ORIGIN_ABSENT, ORIGIN_LATE = 0, 1, 2, 3

OP_PING = 0x01
OP_FIND = 0x10
OP_CONTAINS = 0x11
OP_INSERT_OR_ASSIGN = 0x12
OP_INSERT_AND_EVICT = 0x13
OP_FIND_OR_INSERT = 0x14
OP_ASSIGN = 0x15
OP_ASSIGN_SCORES = 0x16
OP_ACCUM_OR_ASSIGN = 0x17
OP_ERASE = 0x18
OP_ERASE_IF = 0x19
OP_CLEAR = 0x1A
OP_EXPORT = 0x1B
OP_LOAD = 0x1C
OP_SET_EPOCH = 0x1D
OP_RESERVE = 0x1E
OP_APPLY_GRADIENTS = 0x1F
OP_CREATE_TABLE = 0x20
OP_DROP_TABLE = 0x21
OP_FLUSH = 0x2A
OP_LIST_TABLES = 0x22
OP_STATS = 0x23
OP_METRICS = 0x24
OP_SHUTDOWN = 0x25
OP_CHECKPOINT = 0x26
OP_LIST_CHECKPOINTS = 0x27
OP_RESTORE = 0x28
OP_HASH = 0x30
OP_FIND_FEATURES = 0x31
OP_FIND_OR_INSERT_FEATURES = 0x32
OP_ERROR = 0xFF

# The optimizers a table can run in place (create_table's ``optimizer``) and
# the state columns each stores after the values.
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
# How a backed table's writes reach its cluster (create_table's
# ``backing_mode``); the first is the daemon's default.
BACKING_MODES = ("read-only", "write-through", "write-back")


def state_cols(optimizer: Optional[str], dim: int) -> int:
    """Floats of optimizer state a row stores after its ``dim`` values."""
    return {None: 0, "sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim}[optimizer]


def hyper_bytes(lr: float, eps: float, beta1: float, beta2: float, weight_decay: float, step: int) -> bytes:
    """apply_gradients' hyperparameters as the wire carries them (28 bytes);
    one that is no number is a TypeError naming it (struct's own error
    named none)."""
    floats = [float(_typed(v, what, (int, float, np.integer, np.floating), "a number"))
              for what, v in (("lr", lr), ("eps", eps), ("beta1", beta1), ("beta2", beta2),
                              ("weight_decay", weight_decay))]
    return struct.pack("<5fQ", *floats, _uint(step, 64, "step"))


_WRITE_OPS = (OP_INSERT_OR_ASSIGN, OP_INSERT_AND_EVICT, OP_FIND_OR_INSERT, OP_ASSIGN, OP_ACCUM_OR_ASSIGN, OP_LOAD)


class _SizeMismatch(Exception):
    """An answer's array of another size than its request implies."""


class HkvdError(Exception):
    """The daemon refused a request; ``code`` and ``message`` are its own."""

    code = "unknown"

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BadMagic(HkvdError): pass  # noqa: E701
class BadVersion(HkvdError): pass  # noqa: E701
class Oversized(HkvdError): pass  # noqa: E701
class Truncated(HkvdError): pass  # noqa: E701
class UnknownOp(HkvdError): pass  # noqa: E701
class UnknownTable(HkvdError): pass  # noqa: E701
class WrongDim(HkvdError): pass  # noqa: E701
class LengthMismatch(HkvdError): pass  # noqa: E701
class ReservedKey(HkvdError): pass  # noqa: E701
class BadRequest(HkvdError): pass  # noqa: E701
class ScoresError(HkvdError): pass  # noqa: E701
class TableExists(HkvdError): pass  # noqa: E701
class Forbidden(HkvdError): pass  # noqa: E701
class Busy(HkvdError): pass  # noqa: E701
class ShuttingDown(HkvdError): pass  # noqa: E701
class InternalError(HkvdError): pass  # noqa: E701
class ResourceExhausted(HkvdError): pass  # noqa: E701
class NotFound(HkvdError): pass  # noqa: E701
class Timeout(HkvdError): pass  # noqa: E701
class CorruptCheckpoint(HkvdError): pass  # noqa: E701
class BackingUnavailable(HkvdError): pass  # noqa: E701


class ConnectionLost(HkvdError, ConnectionError):
    """The daemon closed or reset the connection (it stopped, was killed or
    restarted): raised by the client itself, with code ``connection_lost``
    and the socket's error, if any, as ``__cause__``. Also a
    ``ConnectionError``. The client is done: open a new one."""


class WrongProcess(HkvdError):
    """A client (or a region, an ``hkvd.torch`` module or cache over it)
    used in a process other than the one that connected it, a child made
    by ``fork()`` (``os.fork``, ``multiprocessing``): raised by the client
    itself, with code ``wrong_process``, before it sends or reads
    anything. A socket shared by two processes mixes their frames, so each
    would read the other's answers; the connection stays the parent's, and
    the child opens its own ``Client``."""


class ProtocolError(Exception):
    """The daemon sent something this client does not understand."""


_ERRORS = {
    "bad_magic": BadMagic,
    "bad_version": BadVersion,
    "oversized": Oversized,
    "truncated": Truncated,
    "unknown_op": UnknownOp,
    "unknown_table": UnknownTable,
    "wrong_dim": WrongDim,
    "length_mismatch": LengthMismatch,
    "reserved_key": ReservedKey,
    "bad_request": BadRequest,
    "scores": ScoresError,
    "table_exists": TableExists,
    "forbidden": Forbidden,
    "busy": Busy,
    "shutting_down": ShuttingDown,
    "internal": InternalError,
    "resource_exhausted": ResourceExhausted,
    "not_found": NotFound,
    "timeout": Timeout,
    "corrupt_checkpoint": CorruptCheckpoint,
    "backing_unavailable": BackingUnavailable,
}


def default_socket() -> str:
    """Where hkvctl looks: $HKVD_SOCKET, else $XDG_RUNTIME_DIR/hkvd/hkvd.sock
    when that directory exists, else ./hkvd-run/hkvd.sock."""
    env = os.environ.get("HKVD_SOCKET")
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "hkvd", "hkvd.sock")
    return os.path.join("hkvd-run", "hkvd.sock")


@dataclass
class Summary:
    """Per-outcome counts of a write: each key is counted once, in the field
    of its outcome (``proto/PROTOCOL.md``, outcome bytes 0-4).

    A key that was absent and is now stored counts in ``inserted`` when it
    took a free slot and in ``evicted`` when it took the slot of another
    entry (which is gone): both were inserted, and ``inserted_total``
    (``inserted + evicted``) is the keys a write added, what hkvctl prints
    as "N inserted (M of them by evicting another entry)"."""

    #: Keys that were present: written in place.
    updated: int = 0
    #: Absent keys stored in a free slot (not those that evicted: see
    #: ``inserted_total``).
    inserted: int = 0
    #: Absent keys stored in the slot of the bucket's minimum-score entry,
    #: which lost it (the number of entries evicted, too).
    evicted: int = 0
    #: Absent keys refused (a score below the full bucket's minimum): not
    #: stored.
    rejected: int = 0
    #: Keys absent for an update-only op (assign, assign_scores): not stored.
    absent: int = 0

    @property
    def inserted_total(self) -> int:
        """The keys this write added to the table: ``inserted + evicted``."""
        return self.inserted + self.evicted


@dataclass
class Evicted:
    """What lost its slot (kind 0) or was refused (kind 1) in insert_and_evict."""

    keys: np.ndarray
    values: np.ndarray
    scores: np.ndarray
    kinds: np.ndarray


def _integers(a: np.ndarray, what: str) -> None:
    """Refuses an array that is not of integers (an empty one is fine):
    floats would be truncated silently (7.9 read as key 7, ids above 2**53
    rounded), strings parsed."""
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers (uint64, or int64 read as their two's complement), "
                        f"not {a.dtype}: convert them first, e.g. np.asarray(x, dtype=np.uint64)")


def _keys(keys) -> np.ndarray:
    a = np.asarray(keys)
    if a.dtype.kind == "f" and isinstance(keys, (list, tuple)) and all(
            isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in keys):
        # Python ints beside numpy uint64 scalars: numpy makes them float64.
        a = np.array([int(k) % (1 << 64) for k in keys], dtype=np.uint64)
    if a.dtype.kind == "O":
        # Python ints numpy cannot hold in 64 bits (2**64, -2**63 - 1).
        wide = [k for k in a.reshape(-1) if isinstance(k, int) and not -(1 << 63) <= k < (1 << 64)]
        if wide:
            raise ValueError(f"key {wide[0]} is out of range: keys are 0 to 2**64 - 1 (negative ones, "
                             f"-2**63 to -1, are read as int64's two's complement)")
    _integers(a, "keys")
    if a.dtype == np.int64:
        a = a.view(np.uint64)
    return np.ascontiguousarray(a, dtype="<u8").reshape(-1)


def _u64(x, what: str = "scores") -> np.ndarray:
    a = np.asarray(x)
    _integers(a, what)
    return np.ascontiguousarray(a, dtype="<u8").reshape(-1)


def _uint(x, bits: int, what: str, lo: int = 0, why: str = "") -> int:
    """``x`` as an int of ``bits`` unsigned bits (at least ``lo``), checked
    before it is packed: a ValueError naming ``what`` and its range (and
    ``why``, when the range is narrower than the wire's) when out of it (a
    TypeError when it is no integer)."""
    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(x).__name__}") from None
    hi = (1 << bits) - 1
    if not lo <= v <= hi:
        raise ValueError(f"{what} must be {lo} to {hi}{why}, not {v}")
    return v


class _ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a TypeError, and a ValueError too,
    which create_table raised for integers and reads_refresh of a wrong
    type before, so code catching that still does (the feature methods
    use it too: numpy's casts raised ValueError for some wrong types)."""


def _typed(v, what: str, types: tuple, wants: str, optional: bool = False):
    """``v``, when it is one of ``types`` (a bool only where ``types`` names
    bool) or None where ``optional``; else a TypeError naming ``what``."""
    if v is None and optional:
        return v
    if isinstance(v, types) and (bool in types or not isinstance(v, (bool, np.bool_))):
        return v
    raise _ArgumentTypeError(f"{what} must be {wants}, not {type(v).__name__}")


def _whole(v, what: str, optional: bool = False) -> Optional[int]:
    """A create_table integer as an int (numpy's too, which json cannot
    write), checked: a TypeError naming ``what`` when it is no integer, a
    ValueError when it is out of 0 to 2**64 - 1."""
    if _typed(v, what, (int, np.integer), "an integer" + (" or None" if optional else ""), optional) is None:
        return None
    v = int(v)
    if not 0 <= v < 1 << 64:
        raise ValueError(f"{what} must be a whole number from 0 to 2**64 - 1, not {v!r}")
    return v


def _seeds(backing) -> List[str]:
    """create_table's ``backing`` as seed URLs: one str "URL,URL" or an
    iterable of str; anything else a TypeError naming it (bytes included:
    a URL is text)."""
    if isinstance(backing, str):
        return [u.strip() for u in backing.split(",")]
    wants = 'the seed URLs, a str ("URL,URL") or a list of str'
    if isinstance(backing, (bytes, bytearray, memoryview)):
        raise _ArgumentTypeError(f"backing must be {wants}, not {type(backing).__name__}")
    try:
        seeds = list(backing)
    except TypeError:
        raise _ArgumentTypeError(f"backing must be {wants}, not {type(backing).__name__}") from None
    return [_typed(u, f"backing[{i}]", (str,), "a str (a seed URL)").strip() for i, u in enumerate(seeds)]


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x), dtype="<f4").reshape(-1)


_HASH_KINDS = {"fingerprint64": 0, "strong": 1}


def _hash_spec(num_buckets: Optional[int], kind: str, key) -> bytes:
    """The wire hash spec: the table's (0xFF) when no num_buckets is given."""
    if num_buckets is None:
        return b"\xff"
    if kind not in _HASH_KINDS:
        raise ValueError(f"hash kind {kind!r} is unknown: use fingerprint64 or strong")
    try:
        k0, k1 = key
    except TypeError:
        raise _ArgumentTypeError(f"key must be a pair (k0, k1) of integers, not {type(key).__name__}") from None
    except ValueError:
        raise ValueError(f"key must be a pair (k0, k1) of integers, not {key!r}") from None
    return struct.pack("<BQQQ", _HASH_KINDS[kind], _uint(num_buckets, 64, "num_buckets"), _uint(k0, 64, "key[0]"),
                       _uint(k1, 64, "key[1]"))


_BYTES = (bytes, bytearray, memoryview)
_U32_MAX = 0xFFFF_FFFF
_I64 = (-(1 << 63), (1 << 63) - 1)


def _is_int(v) -> bool:
    """An integer feature or offset: a Python or numpy int, never a bool
    (``True`` is no int64 feature: TensorFlow would not hash it as "1")."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _offsets(offsets) -> np.ndarray:
    """The ``(bytes, offsets)`` pair's offsets as the wire's u32s, checked
    here: a value outside 0 to 2**32 - 1 would wrap on the wire and pick
    other bytes, so it is a ValueError naming its index and its value as
    given."""
    if isinstance(offsets, np.ndarray) and offsets.dtype.kind in "iu":
        o = offsets.reshape(-1)
        wide = o.astype(np.int64 if o.dtype.kind == "i" else np.uint64)
        bad = np.flatnonzero(wide > np.array(_U32_MAX, wide.dtype))
        if o.dtype.kind == "i":
            bad = np.union1d(bad, np.flatnonzero(wide < 0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"offsets[{i}] = {int(o[i])} is outside 0 to {_U32_MAX} (the wire's u32 offsets)")
        return np.ascontiguousarray(o, dtype="<u4")
    if isinstance(offsets, np.ndarray) and offsets.dtype.kind != "O":
        raise _ArgumentTypeError(f"offsets must be integers, not an array of {offsets.dtype}")
    try:
        items = offsets.reshape(-1).tolist() if isinstance(offsets, np.ndarray) else list(offsets)
    except TypeError:
        raise _ArgumentTypeError(f"offsets must be a sequence of integers, not {type(offsets).__name__}") from None
    for i, v in enumerate(items):
        if not _is_int(v):
            raise _ArgumentTypeError(f"offsets[{i}] must be an integer, not {type(v).__name__}")
        if not 0 <= v <= _U32_MAX:
            raise ValueError(f"offsets[{i}] = {int(v)} is outside 0 to {_U32_MAX} (the wire's u32 offsets)")
    return np.array(items, dtype="<u4")


def _int64_features(items: list) -> Tuple[List, int]:
    """Python ints as the wire's int64 features (type 0), each checked to
    be an int64: the daemon hashes the decimal text of a signed 64-bit
    value, so 2**64 - 1 would be hashed as "-1"."""
    for i, v in enumerate(items):
        if not _I64[0] <= v <= _I64[1]:
            raise ValueError(f"features[{i}] = {int(v)} is not an int64 (-2**63 to 2**63 - 1)")
    a = np.array([int(v) for v in items], dtype="<i8")
    return [b"\x00", *_arr(a)], a.size


def _string_features(items: list) -> Tuple[List, int]:
    """str (as UTF-8) and bytes features as the wire's strings (type 1);
    any other element is a TypeError naming its index (an int there would
    have been taken as a count of zero bytes)."""
    enc = []
    for i, f in enumerate(items):
        if isinstance(f, str):
            enc.append(f.encode())
        elif isinstance(f, _BYTES):
            enc.append(bytes(f))
        else:
            raise _ArgumentTypeError(f"features[{i}] must be a str or bytes like features[0] (string features), "
                                     f"not {type(f).__name__}")
    o = np.zeros(len(enc) + 1, dtype="<u4")
    np.cumsum([len(e) for e in enc], out=o[1:])
    b = np.frombuffer(b"".join(enc), dtype="u1")
    return [b"\x01", *_arr(o), *_arr(b)], len(enc)


def _features(features) -> Tuple[List, int]:
    """Wire parts and count of a feature batch: an integer array or list of
    ints, each an int64; a list or numpy array of str / bytes; or an
    Arrow-style ``(bytes, offsets)`` pair. What the daemon could not hash
    as documented is refused here, naming the argument: a bare str or
    bytes, floats, bools, ints outside int64, a mixed list, offsets outside
    the wire's u32."""
    if isinstance(features, (str, *_BYTES)):
        raise _ArgumentTypeError(f"features must be a sequence of features, not a bare {type(features).__name__} "
                                 "(it would be hashed one character at a time): pass a list, [x] for one feature")
    if (isinstance(features, tuple) and len(features) == 2 and isinstance(features[0], _BYTES)
            and not isinstance(features[1], (str, *_BYTES))):
        data, offsets = features
        o = _offsets(offsets)
        b = np.frombuffer(bytes(data), dtype="u1")
        return [b"\x01", *_arr(o), *_arr(b)], max(o.size - 1, 0)
    if isinstance(features, np.ndarray) and features.dtype.kind != "O":
        a = features.reshape(-1)
        if a.dtype.kind in "US":
            return _string_features(a.tolist())
        if a.dtype.kind not in "iu":
            raise _ArgumentTypeError(f"features must be integers (int64) or strings, not an array of {a.dtype}: "
                                     "int64 features are hashed as their decimal text, floats and bools have none")
        if a.dtype.kind == "u" and a.size and a.max() > _I64[1]:
            i = int(np.flatnonzero(a > np.uint64(_I64[1]))[0])
            raise ValueError(f"features[{i}] = {int(a[i])} is not an int64 (-2**63 to 2**63 - 1)")
        a = np.ascontiguousarray(a, dtype="<i8")
        return [b"\x00", *_arr(a)], a.size
    try:
        items = features.reshape(-1).tolist() if isinstance(features, np.ndarray) else list(features)
    except TypeError:
        raise _ArgumentTypeError(f"features must be a sequence of features, not {type(features).__name__}") from None
    if not items or isinstance(items[0], (str, *_BYTES)):
        return _string_features(items)
    if not _is_int(items[0]):
        raise _ArgumentTypeError(f"features[0] must be a str, bytes or int (an int64 feature), "
                                 f"not {type(items[0]).__name__}")
    for i, v in enumerate(items):
        if not _is_int(v):
            raise _ArgumentTypeError(f"features[{i}] must be an int like features[0] (int64 features), "
                                     f"not {type(v).__name__}")
    return _int64_features(items)


_str = _region._str  # a table name as the wire carries it (one definition, in region.py)


def _filter(key_mask: int, key_pattern: int, min_score: int, max_score: int) -> bytes:
    """erase_if's and export's filter as the wire carries it, each part checked."""
    return struct.pack("<4Q", _uint(key_mask, 64, "key_mask"), _uint(key_pattern, 64, "key_pattern"),
                       _uint(min_score, 64, "min_score"), _uint(max_score, 64, "max_score"))


def _arr(a: np.ndarray) -> List[memoryview]:
    return [memoryview(struct.pack("<I", a.size)), memoryview(a).cast("B")]


class _Pending:
    __slots__ = ("op", "dim", "n", "flags", "out")

    def __init__(self, op: int, dim: int, n: int, flags: int, out: Optional[np.ndarray] = None):
        self.op, self.dim, self.n, self.flags, self.out = op, dim, n, flags, out


def _check_out(out: np.ndarray, n: int, dim: int) -> np.ndarray:
    """``out`` when it can take a find's values: float32, shape (n, dim),
    C-contiguous and writeable."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, not {type(out).__name__}")
    if out.dtype != np.float32 or out.shape != (n, dim):
        raise ValueError(f"out must be float32 of shape ({n}, {dim}), not {out.dtype} of shape {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writeable")
    return out


class Client:
    """A connection to hkvd. Meant for one thread: open one per thread for
    speed. Calls from several threads at once are safe, one request's
    sending or one answer's reading at a time (a thread waiting for its
    answer reads the others' answers and keeps them for them), but the
    ``hkvd.torch`` modules and arrays registered through a client are not:
    use each from one thread. A client belongs to the process that opened
    it: in a child made by ``fork()`` its requests raise
    :class:`WrongProcess` (open a new client there)."""

    def __init__(self, socket: Optional[str] = None, timeout: Optional[float] = None):
        if _typed(timeout, "timeout", (int, float, np.integer, np.floating), "a number of seconds or None",
                  optional=True) is not None:
            if not (math.isfinite(timeout) and timeout > 0):
                raise ValueError(f"timeout must be a positive, finite number of seconds or None (no limit), "
                                 f"not {timeout!r}")
        self.path = socket or default_socket()
        # The process that connected: the only one that may use the socket
        # (:meth:`_here`).
        self._pid = os.getpid()
        self._sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except OSError as e:
            if isinstance(e, PermissionError):
                raise ConnectionError(f"cannot connect to hkvd at {self.path}: this user may not use its socket "
                                      "(a member of the daemon's --client-group or --admin-group may)") from e
            raise ConnectionError(f"cannot connect to hkvd at {self.path} (is it running?): {e}") from e
        self._next = 1
        self._pending: Dict[int, _Pending] = {}
        self._done: Dict[int, object] = {}
        self._dims: Dict[str, int] = {}
        # How many times this client dropped or created each table: the
        # daemon does not refuse a connection's request on a table it made
        # again itself (PROTOCOL.md, "A table made again"), so hkvd.torch
        # compares this count with the one its module or cache was made at.
        self._made: Dict[str, int] = {}
        self._hdr = bytearray(HEADER.size)
        self._body_read = 0  # bytes of the current answer's body read so far
        self._lock = threading.Lock()
        # One request's sending (its id, frame and pending entry) or one
        # answer's reading at a time: threads sharing a client would
        # otherwise interleave frames on the socket.
        self._io = threading.RLock()
        self._regions: Dict[int, int] = {}  # memfd regions: hkvd.shm serial -> region id
        self._cuda_regions: Dict[int, object] = {}  # device regions by allocation buffer id
        # Requests sent without waiting whose answer must be read before any
        # later request (hkvd.torch's optimizer steps): callables that read it.
        self._deferred: List[Callable[[Optional[str]], None]] = []
        # Regions whose shm arrays are gone (hkvd.shm): unregistered with
        # the next request, their answers (request ids in _ignored) dropped.
        self._unneeded: List[int] = []
        self._ignored: set = set()
        # The daemon closed or reset the connection (a ConnectionLost was
        # raised): this client is done.
        self.lost = False
        # close() was called: this client is done too (a request then
        # raises ConnectionLost, :meth:`_closed`).
        self.closed = False

    # ---- plumbing -----------------------------------------------------
    def close(self) -> None:
        """Unregisters this connection's regions and events (the daemon
        would release them with the connection anyway), destroys its CUDA
        events, and closes the socket. A request of this client (or of an
        ``hkvd.torch`` module or cache over it) after this raises
        ``ConnectionLost``, saying the client was closed.

        In a child made by ``fork()`` it sends nothing: it closes the
        child's copy of the socket's descriptor, and the connection (and
        its regions) stay the parent's."""
        if os.getpid() != self._pid:
            self.closed = True
            self._sock.close()
            return
        try:
            _region.release(self)  # its unregisters are this client's last requests
        finally:
            self.closed = True
            self._sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _here(self) -> None:
        """Raises :class:`WrongProcess` in a process other than the one that
        connected (a child made by ``fork()``), before anything is sent,
        read or locked: the child shares the socket with its parent (their
        frames would mix, each reading the other's answers) and its copies
        of the locks may be held by a thread that is not in it. One
        ``getpid`` per request (a fraction of a microsecond): this catches
        every fork, ``os.fork``'s, ``multiprocessing``'s and a C library's
        alike."""
        if os.getpid() != self._pid:
            raise WrongProcess("wrong_process", f"this client connected to the daemon at {self.path} in process "
                                                f"{self._pid}, and this is process {os.getpid()}, a child made "
                                                "by fork(): a connection belongs to the process that opened it "
                                                "(two processes on one socket read each other's answers). "
                                                "Open a new hkvd.Client in this process, and new hkvd.torch "
                                                "modules or caches over it")

    def settle(self) -> None:
        """Reads the answers of requests sent without waiting that must
        come before any later request (an ``hkvd.torch`` module's last
        optimizer step): runs at the start of every request of this client,
        so a later request sees their writes; call it to have their errors
        raised now."""
        self._settle("client.settle()")

    def _settle(self, by: Optional[str] = None) -> None:
        """:meth:`settle`, telling each deferred reader who reads its answer
        (``by``, for its error's message; None: the request about to be
        sent, which then is not)."""
        while True:
            try:
                # Taken one at a time: another thread sharing this client
                # may be reading the same list.
                read = self._deferred.pop(0)
            except IndexError:
                return
            read(by)

    def _send(self, op: int, flags: int, parts: Sequence, dim: int = 0, n: int = 0,
              out: Optional[np.ndarray] = None, settle: bool = True) -> int:
        # settle False: a request the daemon orders after the deferred
        # answers' requests itself (hkvd.region.After), or whose caller
        # read them before taking _io (hkvd.region.raw_call).
        self._here()
        if settle:
            # Before _io, never under it: a deferred reader takes its
            # cache's lock and then _io, and a thread holding that lock
            # (reading the same answer) waits for _io.
            self._settle()
        with self._io:
            if self._unneeded:
                self._unregister_unneeded()
            rid = self._next
            self._next += 1
            body = sum(len(p) if not isinstance(p, memoryview) else p.nbytes for p in parts)
            # Pending before it is sent: another thread may read its answer.
            self._pending[rid] = _Pending(op, dim, n, flags, out)
            try:
                self._sendmsg([HEADER.pack(MAGIC, VERSION, op, flags, rid, body)] + list(parts))
            except BaseException:
                self._pending.pop(rid, None)
                raise
            return rid

    def _unregister_unneeded(self) -> None:
        """Sends an unregister for each region whose shm arrays are gone,
        pipelined before the request being sent; their answers are dropped
        as they arrive."""
        frames = []
        while self._unneeded:
            region = self._unneeded.pop()
            rid = self._next
            self._next += 1
            frames.append(HEADER.pack(MAGIC, VERSION, _shm.OP_UNREGISTER, _shm.F_REGION, rid, 4))
            frames.append(struct.pack("<I", region))
            self._pending[rid] = _Pending(_shm.OP_UNREGISTER, 0, 0, _shm.F_REGION)
            self._ignored.add(rid)
        self._sendmsg(frames)

    def _sendmsg(self, bufs: List, anc: Sequence = ()) -> None:
        """Sends ``bufs`` (with ancillary data ``anc``: an fd). A connection
        the daemon closed raises the error it said it closed it for, if it
        said one, else ``ConnectionLost``; a timeout stays a TimeoutError."""
        self._here()
        if self.closed:
            raise self._closed()
        total = sum(len(b) if not isinstance(b, memoryview) else b.nbytes for b in bufs)
        try:
            sent = self._sock.sendmsg(bufs, anc)
            if sent < total:
                # Rare: the kernel took part of it; send the rest as one buffer.
                rest = b"".join(bytes(b) for b in bufs)[sent:]
                self._sock.sendall(rest)
        except ConnectionError as e:
            # The daemon closed before the request went out: it may have
            # said why first (`busy` past its connection limit, id 0).
            try:
                got, value = self._recv_one()
            except Exception:
                raise self._lost(e) from e
            if got == 0 and isinstance(value, HkvdError):
                raise value from None
            self._done[got] = value  # an earlier request's answer: its result() returns it
            raise self._lost(e) from e

    def _lost(self, e: Optional[OSError]) -> ConnectionLost:
        """The error of a connection the daemon closed (``e`` None: an end of
        stream) or reset."""
        how = f" ({e.strerror or e})" if e is not None else ""
        self.lost = True
        return ConnectionLost("connection_lost", f"the daemon at {self.path} closed the connection{how}: did it "
                                                 "stop or restart? (It also closes a connection left idle past "
                                                 "its --idle-seconds while many are open.) Open a new Client, "
                                                 "once the daemon is back")

    def _closed(self) -> ConnectionLost:
        """The error of a request on this client after :meth:`close` (the
        socket's own was ``OSError: Bad file descriptor``): a
        ``ConnectionLost``, as the connection is gone for good, with a
        message that says who closed it."""
        return ConnectionLost("connection_lost", f"this client of the daemon at {self.path} was closed "
                                                 "(client.close()): open a new Client, and new hkvd.torch modules "
                                                 "or caches over it")

    def _recv_exact(self, view: memoryview) -> None:
        if self.closed:
            raise self._closed()
        got = 0
        n = view.nbytes
        while got < n:
            try:
                k = self._sock.recv_into(view[got:], n - got)
            except ConnectionError as e:
                raise self._lost(e) from e
            if k == 0:
                raise self._lost(None)
            got += k
        self._body_read += n

    def _read(self, n: int) -> bytes:
        b = bytearray(n)
        self._recv_exact(memoryview(b))
        return bytes(b)

    def _u32(self) -> int:
        return struct.unpack("<I", self._read(4))[0]

    def _array(self, dtype: str, expect: Optional[int] = None, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The next array; into ``out`` (of ``expect`` elements) when given."""
        n = self._u32()
        if expect is not None and n != expect:
            raise _SizeMismatch(f"array of {n} elements where {expect} were expected")
        a = out.reshape(-1) if out is not None else np.empty(n, dtype=dtype)
        if n:
            self._recv_exact(memoryview(a).cast("B"))
        return a

    def _summary(self) -> Summary:
        return Summary(*struct.unpack("<5Q", self._read(40)))

    def _recv_one(self) -> Tuple[int, object]:
        """Reads one answer, parsing it by the op of the request it answers.
        An answer whose arrays do not have the sizes the request implies
        (the table was dropped and made again with another dim since this
        client learned it) is read to its end, so the connection stays in
        step, and answered as ``WrongDim``; the dims learned are forgotten."""
        self._here()
        self._recv_exact(memoryview(self._hdr))
        magic, version, op, flags, rid, length = HEADER.unpack(self._hdr)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError(f"bad frame header {bytes(self._hdr)!r}")
        self._body_read = 0
        try:
            return self._parse_answer(op, flags, rid, length)
        except _SizeMismatch as e:
            if self._body_read > length:
                raise ProtocolError(f"an answer longer than its frame ({e})") from None
            self._read(length - self._body_read)
            self._dims.clear()
            self.__dict__.pop("_specs", None)
            return rid, WrongDim("wrong_dim", f"the answer does not fit the table as this client knew it ({e}): "
                                             "was it made again with another dim? Its dims are read again next time")

    def _parse_answer(self, op: int, flags: int, rid: int, length: int) -> Tuple[int, object]:
        p = self._pending.pop(rid, None)
        if op == OP_ERROR:
            err = json.loads(self._read(length))
            cls = _ERRORS.get(err.get("code"), HkvdError)
            if cls is UnknownTable:
                # Gone, or dropped and made again: its spec is learned again.
                self._dims.clear()
                self.__dict__.pop("_specs", None)
            return rid, cls(err.get("code", "?"), err.get("message", ""))
        if p is not None and p.flags & _shm.F_REGION:
            return rid, self._read(length)  # registered regions: decoded by hkvd.shm
        if p is None:
            self._read(length)
            raise ProtocolError(f"answer to unknown request {rid}")
        if op == OP_HASH:
            return rid, self._array("<u8", p.n)
        if op in (OP_FIND, OP_FIND_FEATURES):
            found = self._array("u1", p.n).astype(bool)
            flat = self._array("<f4", p.n * p.dim, p.out)
            values = p.out if p.out is not None else flat.reshape(p.n, p.dim)
            scores = self._array("<u8", p.n) if flags & F_SCORES else None
            if flags & F_OUTCOMES:  # a backed table's per-key origins, asked for
                return rid, (values, found, scores, self._array("u1", p.n))
            return rid, (values, found, scores)
        if op == OP_CONTAINS:
            found = self._array("u1", p.n).astype(bool)
            if flags & F_OUTCOMES:
                return rid, (found, self._array("u1", p.n))
            return rid, found
        if op == OP_APPLY_GRADIENTS:
            missing = struct.unpack("<Q", self._read(8))[0]
            if not flags & F_OUTCOMES:
                return rid, (missing, None, None)
            found = self._array("u1", p.n).astype(bool)
            values = self._array("<f4", p.n * p.dim, p.out)
            return rid, (missing, found, p.out if p.out is not None else values.reshape(p.n, p.dim))
        if op in _WRITE_OPS or op in (OP_ASSIGN_SCORES, OP_FIND_OR_INSERT_FEATURES):
            s = self._summary()
            outcomes = self._array("u1", p.n) if flags & F_OUTCOMES else None
            out: Dict[str, object] = {"summary": s, "outcomes": outcomes}
            if op in (OP_FIND_OR_INSERT, OP_FIND_OR_INSERT_FEATURES):
                out["values"] = self._array("<f4", p.n * p.dim).reshape(p.n, p.dim)
            if op == OP_INSERT_AND_EVICT:
                k = self._array("<u8")
                v = self._array("<f4").reshape(len(k), p.dim)
                out["evicted"] = Evicted(k, v, self._array("<u8"), self._array("u1"))
            return rid, out
        if op in (OP_ERASE, OP_ERASE_IF):
            count = struct.unpack("<Q", self._read(8))[0]
            flags_arr = self._array("u1", p.n).astype(bool) if flags & F_OUTCOMES else None
            return rid, (count, flags_arr)
        if op == OP_EXPORT:
            shard, offset = struct.unpack("<IQ", self._read(12))
            k = self._array("<u8")
            v = self._array("<f4").reshape(len(k), p.dim)
            s = self._array("<u8")
            nxt = None if shard == 0xFFFFFFFF else (shard, offset)
            return rid, (nxt, k, v, s)
        body = self._read(length)
        if op in (OP_CREATE_TABLE, OP_LIST_TABLES, OP_STATS, OP_CHECKPOINT, OP_LIST_CHECKPOINTS, OP_RESTORE):
            return rid, json.loads(body)
        if op == OP_METRICS:
            return rid, body.decode()
        return rid, None

    def result(self, rid: int):
        """The answer to a request sent with a ``send_*`` method (raises its error)."""
        self._here()
        while True:
            # One answer read at a time; another thread's answers are kept
            # for it in _done.
            with self._io:
                if rid in self._done:
                    value = self._done.pop(rid)
                    break
                if rid not in self._pending:
                    # Its answer was read already (or it was never sent):
                    # reading on would wait for an answer that never comes.
                    raise RuntimeError(f"request {rid} of this client has no answer to come: it was read already "
                                       "or never sent")
                got, value = self._recv_one()
                if got == 0 and isinstance(value, HkvdError):
                    # A connection-level error (`busy`, a bad frame): the
                    # daemon closes the connection; it answers every request
                    # still outstanding (PROTOCOL.md, "Connection").
                    for r in self._pending:
                        if r not in self._ignored:
                            self._done[r] = value
                    self._pending.clear()
                    self._ignored.clear()
                    self._done.setdefault(rid, value)
                    continue
                if got in self._ignored:
                    self._ignored.discard(got)
                    continue
                self._done[got] = value
        if isinstance(value, HkvdError):
            raise value
        return value

    def _call(self, op: int, flags: int = 0, parts: Sequence = (), dim: int = 0, n: int = 0):
        return self.result(self._send(op, flags, parts, dim, n))

    def _json(self, op: int, obj=None):
        parts = [json.dumps(obj).encode()] if obj is not None else []
        return self._call(op, 0, parts)

    def _learn(self, info: dict) -> None:
        spec = info["spec"]
        opt = spec.get("optimizer")
        self._dims[spec["name"]] = info.get("row_dim") or spec["dim"] + state_cols(opt, spec["dim"])
        self.__dict__.setdefault("_specs", {})[spec["name"]] = (spec["dim"], opt, spec.get("policy"))

    def dim(self, table: str) -> int:
        """The width of the table's value arrays on the wire: ``spec.dim``,
        plus the optimizer's state columns for a table created with one
        (every op but apply_gradients reads and writes whole rows).
        Cached after the first lookup."""
        if table not in self._dims:
            for t in self.tables():
                self._learn(t)
        if table not in self._dims:
            raise UnknownTable("unknown_table", f"no table named {table!r}; create it first "
                                                "(client.create_table or hkvctl create-table)")
        return self._dims[table]

    def value_dim(self, table: str) -> int:
        """The table's ``spec.dim``: values per row, without optimizer state
        (the width of apply_gradients' gradient and value rows)."""
        self.dim(table)
        return self.__dict__["_specs"][table][0]

    def optimizer(self, table: str) -> Optional[str]:
        """The optimizer the table was created with, or None."""
        self.dim(table)
        return self.__dict__["_specs"][table][1]

    def _step(self, table: str, step) -> int:
        """apply_gradients' ``step``, checked before sending: 0 to 2**64 - 1,
        and from 1 on an Adam table (its bias correction of step 0 divides
        by zero: the daemon refuses it)."""
        if self.optimizer(table) == "adam":
            return _uint(step, 64, "step", 1, " on an Adam table (its bias correction counts steps from 1)")
        return _uint(step, 64, "step")

    def policy(self, table: str) -> Optional[str]:
        """The table's score policy (``lru``, ``lfu``, ``custom`` …)."""
        self.dim(table)
        return self.__dict__["_specs"][table][2]

    # ---- admin --------------------------------------------------------
    def ping(self) -> None:
        self._call(OP_PING)

    def create_table(self, name: str, dim: int, capacity: int, policy: str = "lru", mode: str = "single",
                     max_capacity: int = 0, fast_tier_bytes: Optional[int] = None,
                     num_buckets: Optional[int] = None, hash_kind: str = "fingerprint64",
                     hash_key=(0, 0), lfu_ties: Optional[str] = None,
                     backing: Optional[Union[str, Sequence[str]]] = None,
                     backing_mode: Optional[str] = None,
                     reads_refresh: Optional[bool] = None, optimizer: Optional[str] = None,
                     backing_wait_replicas: Optional[int] = None, backing_deadline_ms: Optional[int] = None,
                     backing_queue_bytes: Optional[int] = None, max_load_factor: Optional[float] = None) -> dict:
        """Creates a table; ``num_buckets`` (with ``hash_kind``) sets the hash
        feature requests use when they name none; ``lfu_ties`` ("lru", the
        daemon's default, or "lowest-slot") the lfu tie rule; ``backing``
        (seed URLs of a Redis Cluster, a list or "URL,URL") puts the cluster
        behind the table, ``backing_mode`` (one of ``BACKING_MODES``:
        "read-only", the default, "write-through" or "write-back") says how
        writes reach it, ``backing_wait_replicas``
        how many replicas of each master must acknowledge a write (Redis
        WAIT; None: the master's acknowledgement), ``backing_deadline_ms``
        how long a read of cache misses waits for the cluster (None: 250),
        ``backing_queue_bytes`` the write-back queue's bound (write-back
        only; None: 64 MiB); ``max_load_factor`` the load past which a
        table with ``max_capacity`` grows (None: 0.5); ``reads_refresh`` whether
        find hits refresh scores (None: on for "adaptive" and for a backed
        table that is not "custom", off for the others; True is refused for
        "custom"; the answer's ``spec["reads_refresh"]`` says what the table
        got);
        ``optimizer`` (one of ``OPTIMIZERS``) makes each row
        ``dim`` values followed by that optimizer's state (sgd: none,
        adagrad: dim, rowwise_adagrad: 1, adam: 2 × dim columns) for
        ``apply_gradients``; the other ops then read and write whole rows
        (``dim(name)`` floats)."""
        # Every argument's type before anything is sent (a wrong one would
        # otherwise fail inside this method, or come back as the daemon's
        # JSON error at some column); the daemon checks their values.
        _typed(name, "name", (str,), "a str")
        dim = _whole(dim, "dim")
        capacity = _whole(capacity, "capacity")
        max_capacity = _whole(max_capacity, "max_capacity")
        fast_tier_bytes = _whole(fast_tier_bytes, "fast_tier_bytes", optional=True)
        num_buckets = _whole(num_buckets, "num_buckets", optional=True)
        backing_wait_replicas = _whole(backing_wait_replicas, "backing_wait_replicas", optional=True)
        backing_deadline_ms = _whole(backing_deadline_ms, "backing_deadline_ms", optional=True)
        backing_queue_bytes = _whole(backing_queue_bytes, "backing_queue_bytes", optional=True)
        for what, v, optional in [("policy", policy, False), ("mode", mode, False), ("hash_kind", hash_kind, False),
                                  ("lfu_ties", lfu_ties, True), ("optimizer", optimizer, True),
                                  ("backing_mode", backing_mode, True)]:
            _typed(v, what, (str,), "a str" + (" or None" if optional else ""), optional)
        try:
            k0, k1 = hash_key
        except (TypeError, ValueError):
            raise _ArgumentTypeError(f"hash_key must be a pair of integers (k0, k1), not {hash_key!r}") from None
        hash_key = [_whole(k0, "hash_key[0]"), _whole(k1, "hash_key[1]")]
        _typed(reads_refresh, "reads_refresh", (bool,), "True, False or None (the policy's default)", optional=True)
        _typed(max_load_factor, "max_load_factor", (int, float, np.integer, np.floating), "a number or None",
               optional=True)
        seeds = None if backing is None else _seeds(backing)
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; not {optimizer!r}")
        spec = {"name": name, "dim": dim, "capacity": capacity, "max_capacity": max_capacity,
                "policy": policy, "mode": mode, "fast_tier_bytes": fast_tier_bytes}
        if num_buckets is not None:
            spec["hash"] = {"kind": hash_kind, "num_buckets": num_buckets, "key": hash_key}
        if lfu_ties is not None:
            spec["lfu_ties"] = lfu_ties
        if max_load_factor is not None:
            # JSON has no inf or nan: json.dumps would write Infinity, which
            # the daemon refuses as unparsable at some column.
            if not math.isfinite(max_load_factor):
                raise ValueError(f"max_load_factor must be a finite number in (0, 1], not {max_load_factor!r}")
            spec["max_load_factor"] = float(max_load_factor)
        if backing_mode is not None and backing_mode not in BACKING_MODES:
            raise ValueError(f"backing_mode must be one of {', '.join(BACKING_MODES)}; not {backing_mode!r}")
        given = [n for n, v in (("backing_mode", backing_mode), ("backing_wait_replicas", backing_wait_replicas),
                                ("backing_deadline_ms", backing_deadline_ms),
                                ("backing_queue_bytes", backing_queue_bytes)) if v is not None]
        if backing is None and given:
            raise ValueError(f"{given[0]} needs backing= (the cluster's seed URLs)")
        backing_mode = backing_mode or BACKING_MODES[0]
        if backing_queue_bytes is not None and backing_mode != "write-back":
            raise ValueError(f"backing_queue_bytes bounds a write-back table's queue; this table is {backing_mode}")
        if seeds is not None:
            spec["backing"] = {"seeds": seeds, "mode": backing_mode}
            if backing_wait_replicas is not None:
                spec["backing"]["wait_replicas"] = backing_wait_replicas
            if backing_deadline_ms is not None:
                spec["backing"]["deadline_ms"] = backing_deadline_ms
            if backing_queue_bytes is not None:
                spec["backing"]["queue_bytes"] = backing_queue_bytes
        if reads_refresh is not None:
            spec["reads_refresh"] = reads_refresh
        if optimizer is not None:
            spec["optimizer"] = optimizer
        info = self._json(OP_CREATE_TABLE, spec)
        self._made[name] = self._made.get(name, 0) + 1
        self._learn(info)
        return info

    def drop_table(self, name: str) -> None:
        self._json(OP_DROP_TABLE, {"name": name})
        self._made[name] = self._made.get(name, 0) + 1
        self._dims.pop(name, None)
        self.__dict__.get("_specs", {}).pop(name, None)

    def flush(self, table: str) -> None:
        """Drains a backed table's write-back queue into its cluster; returns
        once every queued row is there (at once for other tables)."""
        self._json(OP_FLUSH, {"table": table})

    def tables(self) -> List[dict]:
        return self._call(OP_LIST_TABLES)

    def stats(self) -> dict:
        return self._call(OP_STATS)

    def metrics(self) -> str:
        return self._call(OP_METRICS)

    def checkpoint(self, wait: bool = True, full: bool = False):
        """Takes a checkpoint; with ``wait`` returns its listing once complete."""
        return self._json(OP_CHECKPOINT, {"wait": wait, "full": full})

    def checkpoints(self) -> List[dict]:
        return self._call(OP_LIST_CHECKPOINTS)

    def restore(self, checkpoint_id: str = "latest") -> dict:
        return self._json(OP_RESTORE, {"id": checkpoint_id})

    def shutdown(self) -> None:
        self._call(OP_SHUTDOWN)

    # ---- table operations ---------------------------------------------
    def send_find(self, table: str, keys, scores: bool = False, out: Optional[np.ndarray] = None) -> int:
        k = _keys(keys)
        dim = self.dim(table)
        if out is not None:
            _check_out(out, k.size, dim)
        return self._send(OP_FIND, F_SCORES if scores else 0, [_str(table), *_arr(k)], dim, k.size, out)

    def find(self, table: str, keys, scores: bool = False, out: Optional[np.ndarray] = None):
        """``(values (n, dim) float32, found (n,) bool)``, plus scores when asked.
        Misses leave zeros. With ``out`` (float32, shape (n, dim),
        C-contiguous) the values are received into it and it is returned: a
        loop of finds then reuses one array instead of a fresh one each time."""
        values, found, sc = self.result(self.send_find(table, keys, scores, out))
        return (values, found, sc) if scores else (values, found)

    def find_with_origins(self, table: str, keys):
        """``(values, found, origins)``: ``find`` and, on a table backed by a
        cluster, where each key's answer came from (``origins``, uint8 per
        key: ``ORIGIN_HIT`` the cache, ``ORIGIN_FILLED`` read from the
        cluster, ``ORIGIN_ABSENT`` in neither, ``ORIGIN_LATE`` not fetched
        within the table's deadline, then not found instead of an error).
        ``origins`` is None on a table without a cluster."""
        k = _keys(keys)
        r = self.result(self._send(OP_FIND, F_OUTCOMES, [_str(table), *_arr(k)], self.dim(table), k.size))
        return r[0], r[1], (r[3] if len(r) == 4 else None)

    def contains_with_origins(self, table: str, keys):
        """``(found, origins)``: ``contains`` with each key's origin on a
        backed table (as ``find_with_origins``); origins None elsewhere."""
        k = _keys(keys)
        r = self._call(OP_CONTAINS, F_OUTCOMES, [_str(table), *_arr(k)], 0, k.size)
        return r if isinstance(r, tuple) else (r, None)

    # ---- feature hashing ---------------------------------------------
    def hash(self, features, num_buckets: Optional[int] = None, kind: str = "fingerprint64", key=(0, 0),
             table: str = "") -> np.ndarray:
        """Keys (uint64) of raw features, as TensorFlow's ``to_hash_bucket_fast``
        (``kind="fingerprint64"``) or ``to_hash_bucket_strong`` (``kind="strong"``,
        ``key=(k0, k1)``) computes them; int64 features are hashed as their
        decimal text. Without ``num_buckets``, ``table``'s hash setting applies.
        What cannot be hashed as documented (floats, bools, ints outside
        int64, a bare str, offsets outside u32) is refused before sending."""
        if num_buckets is None and not table:
            raise ValueError("hash: give num_buckets= (keys in [0, num_buckets)) or table= (a table created "
                             "with num_buckets, whose hash setting applies)")
        parts, n = _features(features)
        return self._call(OP_HASH, 0, [_str(table), _hash_spec(num_buckets, kind, key), *parts], 0, n)

    def find_features(self, table: str, features, num_buckets: Optional[int] = None, kind: str = "fingerprint64",
                      key=(0, 0), scores: bool = False):
        """Hashes features and finds their keys in one round trip; returns what ``find`` returns."""
        parts, n = _features(features)
        rid = self._send(OP_FIND_FEATURES, F_SCORES if scores else 0,
                         [_str(table), _hash_spec(num_buckets, kind, key), *parts], self.dim(table), n)
        values, found, sc = self.result(rid)
        return (values, found, sc) if scores else (values, found)

    def find_or_insert_features(self, table: str, features, values, num_buckets: Optional[int] = None,
                                kind: str = "fingerprint64", key=(0, 0), scores=None) -> np.ndarray:
        """Hashes features, then ``find_or_insert`` with their keys: the stored
        rows of present keys, ``values`` inserted for the others."""
        parts, n = _features(features)
        wire = [_str(table), _hash_spec(num_buckets, kind, key), *parts, *_arr(_f32(values))]
        flags = 0
        if scores is not None:
            wire += _arr(_u64(scores))
            flags |= F_SCORES
        return self.result(self._send(OP_FIND_OR_INSERT_FEATURES, flags, wire, self.dim(table), n))["values"]

    def contains(self, table: str, keys) -> np.ndarray:
        k = _keys(keys)
        return self._call(OP_CONTAINS, 0, [_str(table), *_arr(k)], 0, k.size)

    def send_write(self, op: int, table: str, keys, values, scores=None, outcomes: bool = False) -> int:
        k = _keys(keys)
        dim = self.dim(table)
        v = _f32(values)
        parts = [_str(table), *_arr(k), *_arr(v)]
        flags = F_OUTCOMES if outcomes else 0
        if scores is not None:
            parts += _arr(_u64(scores))
            flags |= F_SCORES
        return self._send(op, flags, parts, dim, k.size)

    def _write(self, op, table, keys, values, scores, outcomes):
        return self.result(self.send_write(op, table, keys, values, scores, outcomes))

    def insert_or_assign(self, table: str, keys, values, scores=None, outcomes: bool = False):
        """Upsert. Returns a ``Summary`` (and per-key outcome codes when asked:
        0 updated, 1 inserted, 2 evicted another entry, 3 rejected)."""
        r = self._write(OP_INSERT_OR_ASSIGN, table, keys, values, scores, outcomes)
        return (r["summary"], r["outcomes"]) if outcomes else r["summary"]

    def insert_and_evict(self, table: str, keys, values, scores=None) -> Tuple[Summary, Evicted]:
        r = self._write(OP_INSERT_AND_EVICT, table, keys, values, scores, False)
        return r["summary"], r["evicted"]

    def find_or_insert(self, table: str, keys, values, scores=None) -> np.ndarray:
        """Stored values of present keys; the given rows are inserted for the others."""
        return self._write(OP_FIND_OR_INSERT, table, keys, values, scores, False)["values"]

    def assign(self, table: str, keys, values, scores=None) -> Summary:
        return self._write(OP_ASSIGN, table, keys, values, scores, False)["summary"]

    def accum_or_assign(self, table: str, keys, deltas, scores=None) -> Summary:
        return self._write(OP_ACCUM_OR_ASSIGN, table, keys, deltas, scores, False)["summary"]

    def load(self, table: str, keys, values, scores) -> Summary:
        """Insert with scores stored verbatim, whatever the policy (restores)."""
        return self._write(OP_LOAD, table, keys, values, scores, False)["summary"]

    def assign_scores(self, table: str, keys, scores=None) -> Summary:
        k = _keys(keys)
        parts = [_str(table), *_arr(k)]
        flags = 0
        if scores is not None:
            parts += _arr(_u64(scores))
            flags |= F_SCORES
        return self._call(OP_ASSIGN_SCORES, flags, parts, 0, k.size)["summary"]

    def send_apply_gradients(self, table: str, keys, grads, lr: float, eps: float = 1e-8, beta1: float = 0.9,
                             beta2: float = 0.999, weight_decay: float = 0.0, step: int = 1, values: bool = False,
                             out: Optional[np.ndarray] = None, sum: bool = False) -> int:
        k = _keys(keys)
        d = self.value_dim(table)
        g = _f32(grads)
        if out is not None:
            _check_out(out, k.size, d)
        step = self._step(table, step)
        parts = [_str(table), hyper_bytes(lr, eps, beta1, beta2, weight_decay, step), *_arr(k), *_arr(g)]
        flags = (F_OUTCOMES if values else 0) | (F_SUM if sum else 0)
        return self._send(OP_APPLY_GRADIENTS, flags, parts, d, k.size, out)

    def apply_gradients(self, table: str, keys, grads, lr: float, eps: float = 1e-8, beta1: float = 0.9,
                        beta2: float = 0.999, weight_decay: float = 0.0, step: int = 1, values: bool = False,
                        out: Optional[np.ndarray] = None, sum: bool = False):
        """One step of the table's optimizer (the table was created with
        ``optimizer``) on the rows of present ``keys``, given ``grads``
        (n × ``value_dim(table)`` float32); ``step`` counts from 1 (Adam's
        bias correction). Returns the count of keys absent (not updated);
        with ``values``, ``(missing, found (n,) bool, values (n, value_dim))``:
        each key's values after its step (zeros where absent), received into
        ``out`` when given. A key given several times steps once per
        occurrence, or with ``sum`` once with its occurrences' gradients
        summed (in 64-bit fixed point, in no order: PROTOCOL.md, apply_gradients); ``sum`` answers no
        ``values`` and counts absent distinct keys."""
        r = self.result(self.send_apply_gradients(table, keys, grads, lr, eps, beta1, beta2, weight_decay, step,
                                                  values, out, sum))
        return r if values else r[0]

    def erase(self, table: str, keys) -> int:
        k = _keys(keys)
        return self._call(OP_ERASE, 0, [_str(table), *_arr(k)], 0, k.size)[0]

    def erase_if(self, table: str, key_mask: int = 0, key_pattern: int = 0, min_score: int = 0,
                 max_score: int = 2**64 - 1) -> int:
        return self._call(OP_ERASE_IF, 0, [_str(table), _filter(key_mask, key_pattern, min_score, max_score)])[0]

    def clear(self, table: str) -> None:
        self._call(OP_CLEAR, 0, [_str(table)])

    def set_epoch(self, table: str, epoch: int) -> None:
        self._call(OP_SET_EPOCH, 0, [_str(table), struct.pack("<I", _uint(epoch, 32, "epoch"))])

    def reserve(self, table: str, capacity: int) -> None:
        self._call(OP_RESERVE, 0, [_str(table), struct.pack("<Q", _uint(capacity, 64, "capacity"))])

    def export(self, table: str, min_score: int = 0, max_score: int = 2**64 - 1, key_mask: int = 0,
               key_pattern: int = 0, chunk_slots: int = 1 << 16):
        """Every matching entry: ``(keys, values (n, dim), scores)``."""
        filt = struct.pack("<Q", _uint(chunk_slots, 64, "chunk_slots")) + _filter(key_mask, key_pattern, min_score,
                                                                                  max_score)
        dim = self.dim(table)
        cursor = (0, 0)
        ks, vs, ss = [], [], []
        while cursor is not None:
            body = struct.pack("<IQ", cursor[0], cursor[1]) + filt
            cursor, k, v, s = self._call(OP_EXPORT, 0, [_str(table), body], dim, 0)
            ks.append(k)
            vs.append(v)
            ss.append(s)
        return np.concatenate(ks), np.concatenate(vs).reshape(-1, dim), np.concatenate(ss)

    # ---- registered regions (hkvd.shm, hkvd.cuda) ---------------------
    # Every *_region method takes arrays in hkvd.shm_array memory or in CUDA
    # memory (__cuda_array_interface__, torch CUDA tensors), or Refs from
    # region_ref; all arrays of one call lie in one kind of memory. For CUDA
    # arrays, stream / wait / done say how the request is ordered with the
    # caller's GPU work (hkvd.region.call); they are ignored for shm arrays.

    def region_ref(self, a) -> Ref:
        """The region reference to ``a``, registering its memory (a memfd,
        or the CUDA allocation holding it) on this connection the first
        time. ``ref.head(k)`` names its first k rows without a driver call:
        resolve a preallocated buffer once, then name prefixes of it."""
        return _region.ref(self, a)

    def register_cuda(self, a) -> Tuple[int, int]:
        """Registers the CUDA allocation holding ``a`` (any object with
        ``__cuda_array_interface__``, or a torch CUDA tensor) if it is not
        yet, and returns ``(region, offset of a in it)``. Raises
        ``CudaIpcUnavailable`` when the memory cannot be shared with this
        daemon (fall back to shm_array or the socket), TypeError for an
        object that is not CUDA memory."""
        from . import cuda as _cuda

        if _cuda.describe(a) is None:
            raise TypeError(f"{type(a).__name__} is not CUDA memory: register_cuda takes an object with "
                            "__cuda_array_interface__ (CuPy, Numba) or a torch CUDA tensor")
        r = _region.ref(self, a, "array")
        return r.region, r.offset

    def cuda_event(self, device: int = 0) -> CudaEvent:
        """A new interprocess CUDA event on GPU ``device``, registered on
        this connection: pass it as ``wait`` (the client records it on the
        stream) or ``done`` (the daemon records it; ``event.wait(stream)``
        makes a stream wait for the outputs)."""
        return _region.cuda_event(self, device)

    def unregister(self, region: int) -> None:
        """Unregisters a region (or event) id of this connection."""
        self._call(_shm.OP_UNREGISTER, _shm.F_REGION, [struct.pack("<I", _uint(region, 32, "region"))])
        for d in (self._regions, self._cuda_regions):
            for k, v in list(d.items()):
                if (v if isinstance(v, int) else v.id) == region:
                    del d[k]

    def _found_scratch(self, keys, n: int):
        """A scratch found array for ``n`` keys beside ``keys``' memory."""
        k = _region.ref(self, keys, "keys")
        if k.where == "shm":
            return _shm.scratch_found(self, n)
        cache = self.__dict__.setdefault("_device_found", {})
        buf = cache.get(k.device)
        if buf is None or len(buf) < n:
            size = 1 << max(10, (n - 1).bit_length())
            if k.lib == "torch":
                import torch

                buf = torch.empty(size, dtype=torch.uint8, device=f"cuda:{k.device}")
            elif k.lib == "cupy":
                import cupy

                with cupy.cuda.Device(k.device):
                    buf = cupy.empty(size, dtype=cupy.uint8)
            else:
                raise ValueError("pass found= (n uint8 in CUDA memory): the client makes scratch arrays with torch "
                                 "or cupy only")
            cache[k.device] = buf
        return buf[:n]

    def find_region(self, table: str, keys, values, found=None, scores=None, *, stream=None, wait=True,
                    done=False) -> Optional[int]:
        """find with its arrays in registered memory: ``keys`` (n, uint64 or
        int64), ``values`` (n × dim float32, written; misses 0.0),
        ``found`` (n uint8 or bool, written; a scratch array of the client
        when None), ``scores`` (n uint64, written, when given). Returns the
        hits; None with ``done`` on the GPU path, where the daemon answers
        before the lookup ran (see ``hkvd.region.call``)."""
        k = _region.ref(self, keys, "keys")
        if found is None:
            if k.count == 0:
                return 0
            found = self._found_scratch(k, k.count)
        arrays = [k, found, values] + ([scores] if scores is not None else [])
        body = _region.call(self, OP_FIND, table, arrays, scores is not None, False, stream, wait, done)
        return _region.count(body)

    def contains_region(self, table: str, keys, found=None, *, stream=None, wait=True, done=False) -> Optional[int]:
        """contains: ``found`` (n uint8 or bool) written; returns the keys present."""
        k = _region.ref(self, keys, "keys")
        if found is None:
            if k.count == 0:
                return 0
            found = self._found_scratch(k, k.count)
        body = _region.call(self, OP_CONTAINS, table, [k, found], False, False, stream, wait, done)
        return _region.count(body)

    def _write_region(self, op, table, keys, values, scores, outcomes, stream, wait, done) -> Optional[Summary]:
        arrays = [keys, values] + ([scores] if scores is not None else []) + ([outcomes] if outcomes is not None else [])
        body = _region.call(self, op, table, arrays, scores is not None, outcomes is not None, stream, wait, done)
        if body is None:
            return Summary()
        fields = struct.unpack("<5Q", body)
        return None if fields[0] == _region.NOT_COUNTED else Summary(*fields)

    def insert_or_assign_region(self, table: str, keys, values, scores=None, outcomes=None, *, stream=None,
                                wait=True, done=False) -> Optional[Summary]:
        """insert_or_assign with ``keys``, ``values`` (n × dim float32),
        optional ``scores`` (n uint64) read and ``outcomes`` (n uint8) written."""
        return self._write_region(OP_INSERT_OR_ASSIGN, table, keys, values, scores, outcomes, stream, wait, done)

    def insert_and_evict_region(self, table: str, keys, values, evicted_keys, evicted_values, evicted_scores,
                                evicted_kinds, scores=None, outcomes=None, *, stream=None,
                                wait=True) -> Tuple[Summary, int]:
        """insert_and_evict with ``keys`` and ``values`` read; what lost its
        slot (evicted entries, kind 0, and refused inputs, kind 1) written to
        the four ``evicted_*`` arrays (room for c ≥ n entries: uint64 keys,
        c × dim float32 rows, uint64 scores, uint8 kinds) from their start.
        Returns the summary and how many entries were written."""
        arrays = [keys, values] + ([scores] if scores is not None else []) + \
            ([outcomes] if outcomes is not None else []) + [evicted_keys, evicted_values, evicted_scores, evicted_kinds]
        body = _region.call(self, OP_INSERT_AND_EVICT, table, arrays, scores is not None, outcomes is not None,
                            stream, wait, False)
        if body is None:
            return Summary(), 0
        f = struct.unpack("<6Q", body)
        return Summary(*f[:5]), f[5]

    def export_region(self, table: str, keys, values, scores, cursor=(0, 0), max_slots: Optional[int] = None,
                      min_score: int = 0, max_score: int = 2**64 - 1, key_mask: int = 0, key_pattern: int = 0, *,
                      stream=None, wait=True):
        """One export step into registered memory: the matching entries of
        up to ``max_slots`` slots (default: as many as ``keys`` has room
        for) from ``cursor`` (``(shard, offset)``; start at ``(0, 0)``)
        written to ``keys`` (c uint64), ``values`` (c × dim float32) and
        ``scores`` (c uint64) from their start. Returns ``(next_cursor,
        count)``; ``next_cursor`` is None at the end of the table."""
        cap = _region.ref(self, keys, "keys").count
        slots = cap if max_slots is None else max_slots
        shard, offset = cursor
        head = struct.pack("<IQQ", _uint(shard, 32, "cursor[0] (the shard)"), _uint(offset, 64, "cursor[1] (the offset)"),
                           _uint(slots, 64, "max_slots")) + _filter(key_mask, key_pattern, min_score, max_score)
        body = _region.call(self, _region.OP_EXPORT, table, [keys, values, scores], False, False, stream, wait,
                            False, head)
        if body is None:
            return cursor, 0
        shard, offset, count = struct.unpack("<IQQ", body)
        return (None if shard == 0xFFFF_FFFF else (shard, offset)), count

    def find_or_insert_region(self, table: str, keys, values, scores=None, outcomes=None, *, stream=None,
                              wait=True, done=False) -> Optional[Summary]:
        """find_or_insert: ``values`` holds the rows to insert for absent
        keys and is overwritten with every key's stored row."""
        return self._write_region(OP_FIND_OR_INSERT, table, keys, values, scores, outcomes, stream, wait, done)

    def assign_region(self, table: str, keys, values, scores=None, outcomes=None, *, stream=None, wait=True,
                      done=False) -> Optional[Summary]:
        return self._write_region(OP_ASSIGN, table, keys, values, scores, outcomes, stream, wait, done)

    def accum_or_assign_region(self, table: str, keys, deltas, scores=None, outcomes=None, *, stream=None,
                               wait=True, done=False) -> Optional[Summary]:
        """accum_or_assign: ``deltas`` added to present keys' rows, stored for absent ones."""
        return self._write_region(OP_ACCUM_OR_ASSIGN, table, keys, deltas, scores, outcomes, stream, wait, done)

    def apply_gradients_region(self, table: str, keys, grads, found=None, values=None, *, lr: float,
                               eps: float = 1e-8, beta1: float = 0.9, beta2: float = 0.999, weight_decay: float = 0.0,
                               step: int = 1, stream=None, wait=True, done=False, sum: bool = False) -> int:
        """apply_gradients with ``keys`` (n) and ``grads`` (n × value_dim
        float32) read from registered memory and, when both are given,
        ``found`` (n uint8, written: 1 updated, 0 absent) and ``values``
        (n × value_dim float32, written: the values after the step).
        Returns the count of keys absent. ``sum`` as for
        :meth:`apply_gradients` (then without ``found`` and ``values``)."""
        outcomes = found is not None or values is not None
        if outcomes and (found is None or values is None):
            raise ValueError("give both found and values, or neither")
        arrays = [keys, grads] + ([found, values] if outcomes else [])
        head = hyper_bytes(lr, eps, beta1, beta2, weight_decay, self._step(table, step))
        body = _region.call(self, OP_APPLY_GRADIENTS, table, arrays, False, outcomes, stream, wait, done, head,
                            F_SUM if sum else 0)
        return _region.count(body)

    def erase_region(self, table: str, keys, erased=None, *, stream=None, wait=True, done=False) -> Optional[int]:
        """erase; ``erased`` (n uint8) written when given. Returns the count erased."""
        arrays = [keys] + ([erased] if erased is not None else [])
        body = _region.call(self, OP_ERASE, table, arrays, False, erased is not None, stream, wait, done)
        return _region.count(body)

    def find_shm(self, table: str, keys, values, found=None) -> int:
        """find_region (the name it had when regions were memfds only)."""
        return self.find_region(table, keys, values, found)

    def insert_or_assign_shm(self, table: str, keys, values, scores=None) -> Summary:
        """insert_or_assign_region (the name it had when regions were memfds only)."""
        return self.insert_or_assign_region(table, keys, values, scores)
