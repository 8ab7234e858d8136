"""Device memory for registered regions: CUDA IPC through libcuda, with
ctypes only (``proto/PROTOCOL.md``, "register_cuda (0x42)",
"register_cuda_event (0x43)", "Events" and "Device regions").

Any object with ``__cuda_array_interface__`` (CuPy arrays, PyTorch CUDA
tensors, Numba arrays) or a torch CUDA tensor can be named in a region
request. A framework's caching allocator hands out pieces of larger
allocations, and a CUDA IPC handle names a whole allocation, so the client
registers the **allocation** holding the array (its base and size from
``cuMemGetAddressRange``) once per connection, keyed by the allocation's
process-wide buffer id (``CU_POINTER_ATTRIBUTE_BUFFER_ID``, never reused,
unlike addresses), and names the array by its offset from the base. Tensors
that share one segment of PyTorch's allocator share one region.

libcuda is loaded on first use (``ctypes.CDLL("libcuda.so.1")``); every
call's ``CUresult`` is checked and a failure raises :class:`CudaError`
with the error's name. The calls run with the primary context of the
pointer's device current (the context PyTorch and CuPy use), pushed and
popped around them.

Memory that cannot be shared this way (no driver, memory from
``cuMemCreate`` such as PyTorch's ``expandable_segments:True``, or from
``cudaMallocAsync``; a daemon on the CPU backend or without that GPU)
raises :class:`CudaIpcUnavailable`, so callers can fall back to shared
memory or the socket.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import threading
from contextlib import contextmanager
from typing import Dict, Optional, Tuple

import numpy as np

OP_REGISTER_CUDA = 0x42
OP_REGISTER_CUDA_EVENT = 0x43

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_INVALID_CONTEXT = 201
# CUpointer_attribute (cuda.h).
CU_POINTER_ATTRIBUTE_CONTEXT = 1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
# CUmemorytype.
CU_MEMORYTYPE_HOST = 1
CU_MEMORYTYPE_DEVICE = 2
CU_MEMORYTYPE_ARRAY = 3
CU_MEMORYTYPE_UNIFIED = 4
# cuEventCreate flags.
CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4

UUID_LEN = 16
IPC_HANDLE_LEN = 64

CUdeviceptr = ctypes.c_uint64
_IpcHandle = ctypes.c_ubyte * IPC_HANDLE_LEN  # CUipcMemHandle / CUipcEventHandle: char reserved[64]
_Uuid = ctypes.c_ubyte * UUID_LEN  # CUuuid: char bytes[16]


class CudaIpcUnavailable(Exception):
    """This memory cannot be registered with this daemon through CUDA IPC:
    fall back to ``hkvd.shm_array`` or the socket. ``reason`` is one of
    ``no_driver``, ``not_exportable``, ``daemon`` (the daemon refused:
    ``code`` and ``message`` are its own)."""

    def __init__(self, reason: str, message: str, code: str = ""):
        super().__init__(message)
        self.reason = reason
        self.code = code
        self.message = message


class CudaError(RuntimeError):
    """A libcuda call failed: ``call`` is its name, ``result`` the CUresult
    and ``name`` its CUDA_ERROR_… name."""

    def __init__(self, call: str, result: int, name: str):
        super().__init__(f"{call} failed: {name} ({result})")
        self.call = call
        self.result = result
        self.name = name


# ---- libcuda ------------------------------------------------------------

class _Driver:
    """The libcuda entry points this module uses, with their signatures."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaIpcUnavailable(
                "no_driver", f"libcuda.so.1 cannot be loaded ({e}): this host has no NVIDIA driver, "
                "so device memory cannot be registered; use hkvd.shm_array or the socket") from None
        self.lib = lib
        P, c_int, c_uint, c_void_p = ctypes.POINTER, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p

        def fn(names, *argtypes):
            for name in names:
                f = getattr(lib, name, None)
                if f is not None:
                    f.restype = c_int
                    f.argtypes = list(argtypes)
                    f.hkvd_name = name
                    return f
            raise CudaIpcUnavailable("no_driver", f"libcuda.so.1 has no {' or '.join(names)}: the driver is too old")

        self.cuInit = fn(["cuInit"], c_uint)
        self.cuGetErrorName = fn(["cuGetErrorName"], c_int, P(ctypes.c_char_p))
        self.cuPointerGetAttribute = fn(["cuPointerGetAttribute"], c_void_p, c_int, CUdeviceptr)
        self.cuPointerGetAttributes = fn(["cuPointerGetAttributes"], c_uint, P(c_int), P(c_void_p), CUdeviceptr)
        self.cuDeviceGet = fn(["cuDeviceGet"], P(c_int), c_int)
        self.cuDeviceGetUuid = fn(["cuDeviceGetUuid_v2", "cuDeviceGetUuid"], P(_Uuid), c_int)
        self.cuDevicePrimaryCtxRetain = fn(["cuDevicePrimaryCtxRetain"], P(c_void_p), c_int)
        self.cuCtxPushCurrent = fn(["cuCtxPushCurrent_v2"], c_void_p)
        self.cuCtxPopCurrent = fn(["cuCtxPopCurrent_v2"], P(c_void_p))
        self.cuCtxGetCurrent = fn(["cuCtxGetCurrent"], P(c_void_p))
        self.cuMemGetAddressRange = fn(["cuMemGetAddressRange_v2"], P(CUdeviceptr), P(ctypes.c_size_t), CUdeviceptr)
        self.cuIpcGetMemHandle = fn(["cuIpcGetMemHandle"], P(_IpcHandle), CUdeviceptr)
        self.cuEventCreate = fn(["cuEventCreate"], P(c_void_p), c_uint)
        self.cuEventDestroy = fn(["cuEventDestroy_v2"], c_void_p)
        self.cuIpcGetEventHandle = fn(["cuIpcGetEventHandle"], P(_IpcHandle), c_void_p)
        self.cuEventRecord = fn(["cuEventRecord"], c_void_p, c_void_p)
        self.cuEventSynchronize = fn(["cuEventSynchronize"], c_void_p)
        self.cuStreamWaitEvent = fn(["cuStreamWaitEvent"], c_void_p, c_void_p, c_uint)
        self.cuStreamSynchronize = fn(["cuStreamSynchronize"], c_void_p)
        self.cuStreamQuery = fn(["cuStreamQuery"], c_void_p)

    def error_name(self, result: int) -> str:
        s = ctypes.c_char_p()
        if self.cuGetErrorName(result, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode()
        return f"CUresult {result}"

    def check(self, f, *args) -> None:
        r = f(*args)
        if r != CUDA_SUCCESS:
            raise CudaError(f.hkvd_name, r, self.error_name(r))


_DRIVER: Optional[_Driver] = None
_LOCK = threading.Lock()
# Primary context of each device ordinal, retained for the process's life:
# releasing it could destroy the context (when no framework holds it) and
# with it the events and IPC handles this module made in it.
_PRIMARY: Dict[int, int] = {}


def driver() -> _Driver:
    """libcuda, loaded and initialised on first use."""
    global _DRIVER
    if _DRIVER is None:
        with _LOCK:
            if _DRIVER is None:
                d = _Driver()
                r = d.cuInit(0)
                if r != CUDA_SUCCESS:
                    raise CudaIpcUnavailable(
                        "no_driver", f"cuInit failed: {d.error_name(r)} ({r}): no usable GPU; "
                        "use hkvd.shm_array or the socket")
                _DRIVER = d
    return _DRIVER


def is_current(ordinal: int) -> bool:
    """Whether the primary context of device ``ordinal`` (once this module
    retained it) is already the calling thread's current context: as it is
    on a thread where torch ran work on that device. Then an event's record
    or wait needs no push and pop of the context around it (4 of a record's
    8.6 us on the H200 host)."""
    ctx = _PRIMARY.get(ordinal)
    if ctx is None:
        return False
    d = driver()
    c = ctypes.c_void_p()
    return d.cuCtxGetCurrent(ctypes.byref(c)) == CUDA_SUCCESS and c.value == ctx


@contextmanager
def current(ordinal: int):
    """Makes the primary context of device ``ordinal`` current for the block."""
    d = driver()
    ctx = _PRIMARY.get(ordinal)
    if ctx is None:
        dev = ctypes.c_int()
        d.check(d.cuDeviceGet, ctypes.byref(dev), ordinal)
        c = ctypes.c_void_p()
        d.check(d.cuDevicePrimaryCtxRetain, ctypes.byref(c), dev)
        ctx = _PRIMARY.setdefault(ordinal, c.value)
    d.check(d.cuCtxPushCurrent, ctypes.c_void_p(ctx))
    try:
        yield
    finally:
        old = ctypes.c_void_p()
        d.cuCtxPopCurrent(ctypes.byref(old))


def device_uuid(ordinal: int) -> bytes:
    """The 16 bytes of ``cuDeviceGetUuid`` of device ``ordinal`` (this
    process's numbering), which the daemon matches against its GPUs."""
    d = driver()
    dev = ctypes.c_int()
    d.check(d.cuDeviceGet, ctypes.byref(dev), ordinal)
    u = _Uuid()
    d.check(d.cuDeviceGetUuid, ctypes.byref(u), dev)
    return bytes(u)


def pointer_info(ptr: int) -> Tuple[int, int, int]:
    """``(memory type, buffer id, device ordinal)`` of an address; memory
    type 0 when CUDA does not know it (one driver call)."""
    d = driver()
    attrs = (ctypes.c_int * 3)(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                               CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
    # 8 zeroed bytes per attribute, whatever width the driver writes
    # (unsigned int, unsigned long long, int).
    out = (ctypes.c_uint64 * 3)()
    ptrs = (ctypes.c_void_p * 3)(*[ctypes.addressof(out) + 8 * i for i in range(3)])
    r = d.cuPointerGetAttributes(3, attrs, ptrs, ptr)
    if r == CUDA_ERROR_INVALID_CONTEXT:
        with current(0):
            d.check(d.cuPointerGetAttributes, 3, attrs, ptrs, ptr)
    elif r != CUDA_SUCCESS:
        raise CudaError("cuPointerGetAttributes", r, d.error_name(r))
    mtype = out[0] & 0xFFFFFFFF
    ordinal = ctypes.c_int32.from_buffer(out, 16).value
    return mtype, out[1], ordinal


def _ipc_capable(ptr: int) -> Optional[bool]:
    """Whether cuIpcGetMemHandle can export the allocation of ``ptr`` (None
    when the driver cannot say)."""
    d = driver()
    v = ctypes.c_uint64(0)
    r = d.cuPointerGetAttribute(ctypes.byref(v), CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
    return None if r != CUDA_SUCCESS else bool(v.value & 0xFF)


def allocation(ptr: int, ordinal: int) -> Tuple[int, int, bytes]:
    """``(base, size, CUipcMemHandle bytes)`` of the allocation holding ``ptr``."""
    d = driver()
    with current(ordinal):
        base, size = CUdeviceptr(), ctypes.c_size_t()
        d.check(d.cuMemGetAddressRange, ctypes.byref(base), ctypes.byref(size), ptr)
        if _ipc_capable(base.value) is False:
            raise CudaIpcUnavailable("not_exportable", _NOT_EXPORTABLE.format(ptr=ptr))
        h = _IpcHandle()
        r = d.cuIpcGetMemHandle(ctypes.byref(h), base.value)
        if r != CUDA_SUCCESS:
            raise CudaIpcUnavailable(
                "not_exportable", _NOT_EXPORTABLE.format(ptr=ptr) + f" (cuIpcGetMemHandle: {d.error_name(r)})")
        return base.value, size.value, bytes(h)


_NOT_EXPORTABLE = (
    "the allocation holding 0x{ptr:x} cannot be exported with cuIpcGetMemHandle: it comes from cuMemCreate "
    "(PyTorch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or a stream-ordered pool (cudaMallocAsync). "
    "Allocate with cudaMalloc (PyTorch's default allocator, expandable_segments:False) or use hkvd.shm_array")


# ---- arrays -------------------------------------------------------------

_TORCH_DTYPES = {
    "torch.float32": "float32", "torch.float64": "float64", "torch.float16": "float16",
    "torch.int64": "int64", "torch.int32": "int32", "torch.int16": "int16", "torch.int8": "int8",
    "torch.uint8": "uint8", "torch.bool": "bool", "torch.uint16": "uint16", "torch.uint32": "uint32",
    "torch.uint64": "uint64",
}


class DeviceArray:
    """What a region request needs of a CUDA array: address, bytes, shape,
    dtype, whether it is C-contiguous, the device it says it is on (-1
    when it does not say) and which library made it (for its current
    stream: ``torch``, ``cupy`` or ``cai``)."""

    __slots__ = ("ptr", "nbytes", "shape", "dtype", "contiguous", "device", "lib", "obj")

    def __init__(self, ptr, nbytes, shape, dtype, contiguous, device, lib, obj):
        self.ptr, self.nbytes, self.shape, self.dtype = ptr, nbytes, shape, dtype
        self.contiguous, self.device, self.lib, self.obj = contiguous, device, lib, obj

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "is_cuda")


def _c_contiguous(shape, strides, itemsize) -> bool:
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expect:
            return False
        expect *= dim
    return True


def describe(x) -> Optional[DeviceArray]:
    """The CUDA array ``x`` is, or None when it is none (a numpy array, a
    CPU tensor, a list...)."""
    if _is_torch(x):
        if not x.is_cuda:
            return None
        name = _TORCH_DTYPES.get(str(x.dtype))
        dtype = np.dtype(name) if name else None
        shape = tuple(int(s) for s in x.shape)
        return DeviceArray(int(x.data_ptr()), int(x.numel()) * x.element_size(), shape, dtype,
                           x.is_contiguous(), x.device.index if x.device.index is not None else -1, "torch", x)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        return None
    shape = tuple(int(s) for s in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    contiguous = strides is None or _c_contiguous(shape, strides, dtype.itemsize)
    dev = getattr(x, "device", None)
    device = getattr(dev, "id", -1)
    lib = "cupy" if type(x).__module__.startswith("cupy") else "cai"
    size = int(np.prod(shape, dtype=np.int64))
    return DeviceArray(int(cai["data"][0]), size * dtype.itemsize, shape, dtype, contiguous,
                       device if isinstance(device, int) else -1, lib, x)


def stream_handle(stream, lib: str, ordinal: int) -> int:
    """The CUstream of ``stream`` (an int, a torch.cuda.Stream, a cupy
    Stream), or by default the current stream of the library that made the
    arrays (torch or cupy) on device ``ordinal``; else the legacy default
    stream (0)."""
    if stream is None:
        if lib == "torch" and "torch" in sys.modules:
            return torch_stream(ordinal)
        if lib == "cupy" and "cupy" in sys.modules:
            cupy = sys.modules["cupy"]
            with cupy.cuda.Device(ordinal):
                return int(cupy.cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    raise TypeError(f"stream must be an int CUstream, a torch.cuda.Stream or a cupy Stream, "
                    f"not {type(stream).__name__}")


def torch_stream(ordinal: int) -> int:
    """torch's current CUstream on device ``ordinal``: its raw handle where
    torch gives it directly (about 0.5 us), else through a
    ``torch.cuda.Stream`` object (about 6 us on the H200 host: a request
    asks it once or twice)."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(ordinal))
    return int(torch.cuda.current_stream(ordinal).cuda_stream)


def synchronize(stream: int, ordinal: int) -> None:
    """Blocks until the work queued on ``stream`` is done."""
    d = driver()
    with current(ordinal):
        d.check(d.cuStreamSynchronize, ctypes.c_void_p(stream))


# ---- events -------------------------------------------------------------

class CudaEvent:
    """An interprocess CUDA event (``CU_EVENT_INTERPROCESS |
    CU_EVENT_DISABLE_TIMING``) on device ``ordinal``, registered on one
    connection (``id``) by :meth:`hkvd.Client.cuda_event`."""

    def __init__(self, ordinal: int):
        d = driver()
        self.device = ordinal
        self.id = 0
        with current(ordinal):
            ev = ctypes.c_void_p()
            d.check(d.cuEventCreate, ctypes.byref(ev), CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)
            self._ev = ev.value
            h = _IpcHandle()
            try:
                d.check(d.cuIpcGetEventHandle, ctypes.byref(h), ctypes.c_void_p(self._ev))
            except CudaError:
                d.cuEventDestroy(ctypes.c_void_p(self._ev))
                self._ev = None
                raise
        self.handle = bytes(h)
        self.uuid = device_uuid(ordinal)

    def record(self, stream: int = 0) -> None:
        """Records the event on ``stream`` (a CUstream; 0 the legacy default),
        then submits the stream's pending work (``cuStreamQuery``): the daemon
        asks the event from the host, and a record still queued in this
        process, not yet submitted, read there as complete."""
        self._on_device(self._record, stream)

    def _on_device(self, f, *args) -> None:
        """``f(*args)`` with the device's primary context current, pushed
        only where it is not already (:func:`is_current`)."""
        if is_current(self.device):
            f(*args)
        else:
            with current(self.device):
                f(*args)

    def _record(self, stream: int) -> None:
        d = driver()
        s = ctypes.c_void_p(stream)
        d.check(d.cuEventRecord, ctypes.c_void_p(self._ev), s)
        r = d.cuStreamQuery(s)
        if r not in (CUDA_SUCCESS, CUDA_ERROR_NOT_READY):
            raise CudaError("cuStreamQuery", r, d.error_name(r))

    def wait(self, stream: int = 0) -> None:
        """Makes ``stream`` wait (on the GPU) for the event's last record."""
        d = driver()
        self._on_device(d.check, d.cuStreamWaitEvent, ctypes.c_void_p(stream), ctypes.c_void_p(self._ev), 0)

    def synchronize(self) -> None:
        """Blocks the calling thread until the event's last record completed."""
        d = driver()
        with current(self.device):
            d.check(d.cuEventSynchronize, ctypes.c_void_p(self._ev))

    def destroy(self) -> None:
        if self._ev is not None:
            d = driver()
            with current(self.device):
                d.cuEventDestroy(ctypes.c_void_p(self._ev))
            self._ev = None


# ---- wire ---------------------------------------------------------------

def register_body(uuid: bytes, handle: bytes, nbytes: Optional[int]) -> bytes:
    """The body of ``register_cuda`` (88 bytes: uuid, handle, u64 len) or,
    with ``nbytes`` None, of ``register_cuda_event`` (80 bytes)."""
    if len(uuid) != UUID_LEN or len(handle) != IPC_HANDLE_LEN:
        raise ValueError(f"a device uuid is {UUID_LEN} bytes and an IPC handle {IPC_HANDLE_LEN}")
    return uuid + handle + (b"" if nbytes is None else struct.pack("<Q", nbytes))
