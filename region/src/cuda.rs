//! CUDA IPC, the client's side (`proto/PROTOCOL.md`, "register_cuda" and
//! "register_cuda_event"): what a process that owns device memory sends
//! hkvd so that the daemon can open it, and the interprocess events that
//! order the client's stream with the daemon's.
//!
//! cudarc is loaded dynamically: every function here first checks that the
//! driver library is present (and initialises it), so on a host without
//! CUDA they return [`CudaError::Unavailable`] instead of panicking.
//!
//! Contexts: [`export_memory`] and [`DeviceAlloc`] / [`IpcEvent`] calls run
//! in a context that must be current on the calling thread (cudarc binds a
//! context when it is created, `CudaContext::new`, and on
//! `CudaContext::bind_to_thread`; PyTorch and CuPy bind the device's
//! primary context, which is the one `CudaContext::new` retains).
//!
//! Which memory exports: `cuIpcGetMemHandle` names a whole allocation made
//! with `cuMemAlloc` / `cudaMalloc` (PyTorch's caching allocator makes
//! those). Memory from a stream-ordered pool (`cuMemAllocAsync`, which
//! cudarc's `CudaStream::alloc_zeros` uses on GPUs with memory pools),
//! from `cuMemCreate` or managed memory does not: [`export_memory`] says so
//! ([`CudaError::NotExportable`]). [`DeviceAlloc`] is an allocation that
//! does export.

use std::sync::{Arc, OnceLock};

pub use cudarc;
use cudarc::driver::{sys, CudaContext, CudaStream};
use zerocopy::{FromBytes, Immutable, IntoBytes};

/// Bytes of a device UUID (`CUuuid`).
pub const UUID_LEN: usize = 16;
/// Bytes of a `CUipcMemHandle` / `CUipcEventHandle`.
pub const HANDLE_LEN: usize = 64;

/// What a CUDA IPC call can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No CUDA driver library on this host, or the driver reports no
    /// device (or cannot be initialised): nothing here can work.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// No CUDA context is current on the calling thread.
    #[error(
        "no CUDA context is current on this thread: bind the allocation's context first (cudarc: CudaContext::bind_to_thread)"
    )]
    NoContext,
    /// The pointer is not device memory: host memory (pageable or
    /// registered) or an address CUDA does not know.
    #[error("0x{ptr:x} is not device memory ({why}): register host memory with register_memfd instead")]
    NotDevice {
        /// The pointer given.
        ptr: u64,
        /// What CUDA said about it.
        why: String,
    },
    /// Device memory that `cuIpcGetMemHandle` cannot export.
    #[error(
        "the allocation holding 0x{ptr:x} cannot be exported with cuIpcGetMemHandle ({why}): allocate it with cuMemAlloc / cudaMalloc (e.g. hkv_region::cuda::DeviceAlloc, PyTorch's default allocator)"
    )]
    NotExportable {
        /// The pointer given.
        ptr: u64,
        /// Why (a pool allocation, cuMemCreate, managed memory, the driver's error).
        why: String,
    },
    /// A driver call failed.
    #[error("{call} failed: {result:?}")]
    Driver {
        /// The CUDA call.
        call: &'static str,
        /// Its result.
        result: sys::CUresult,
    },
    /// A copy or fill outside an allocation, or a stream of another context.
    #[error("{0}")]
    Invalid(String),
}

/// Result alias.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

fn check(call: &'static str, result: sys::CUresult) -> Result<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver { call, result })
    }
}

/// Loads and initialises the driver once per process; the device count.
fn init() -> Result<usize> {
    static INIT: OnceLock<Result<usize, String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to load the driver library; no CUDA call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver library (libcuda.so) on this host".into());
        }
        // SAFETY: cuInit takes flags 0 and touches no memory of ours; the
        // library is present (checked above), so the call does not panic.
        let r = unsafe { sys::cuInit(0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuInit failed ({r:?})"));
        }
        let mut n = 0i32;
        // SAFETY: writes one int through a valid pointer.
        let r = unsafe { sys::cuDeviceGetCount(&mut n) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuDeviceGetCount failed ({r:?})"));
        }
        if n <= 0 {
            return Err("the CUDA driver is present but reports no device".into());
        }
        Ok(n as usize)
    })
    .clone()
    .map_err(CudaError::Unavailable)
}

/// The number of CUDA devices, or [`CudaError::Unavailable`] saying why
/// there are none (no driver library, no device). Never panics: call it
/// before any cudarc call (`CudaContext::new` panics without a driver).
pub fn available() -> Result<usize> {
    init()
}

/// `cuDeviceGetUuid_v2` of device `ordinal` (the bytes of its `CUuuid`), as
/// register_cuda names it.
pub fn device_uuid(ordinal: usize) -> Result<[u8; UUID_LEN]> {
    let count = init()?;
    if ordinal >= count {
        return Err(CudaError::Invalid(format!("no CUDA device {ordinal}: this host has {count}")));
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one CUdevice through a valid pointer; the driver is
    // initialised (init above).
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) })?;
    let mut uuid = sys::CUuuid { bytes: [0; UUID_LEN] };
    // SAFETY: writes one CUuuid through a valid pointer, for a device the
    // driver just named.
    check("cuDeviceGetUuid_v2", unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) })?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// What register_cuda sends for device memory: the allocation holding a
/// pointer, exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemExport {
    /// `cuDeviceGetUuid_v2` of the allocation's device.
    pub uuid: [u8; UUID_LEN],
    /// `cuIpcGetMemHandle` of the allocation's base.
    pub handle: [u8; HANDLE_LEN],
    /// The allocation's first byte (`cuMemGetAddressRange`).
    pub base: u64,
    /// The allocation's size in bytes.
    pub size: u64,
    /// The pointer's offset from `base`.
    pub offset: u64,
}

fn attribute<T: Copy>(ptr: u64, attr: sys::CUpointer_attribute, zero: T) -> Result<T, sys::CUresult> {
    let mut v = zero;
    // SAFETY: `v` is a valid, writable T of the size the attribute writes
    // (the callers pair each attribute with its C type: u32 for the memory
    // type, int for the ordinal and booleans, a pointer for the pool); the
    // driver only reads the address `ptr`'s bookkeeping, not its memory.
    let r = unsafe { sys::cuPointerGetAttribute((&mut v as *mut T).cast(), attr, ptr) };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(v)
    } else {
        Err(r)
    }
}

fn current_context() -> Result<()> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context handle through a valid pointer.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    if ctx.is_null() {
        return Err(CudaError::NoContext);
    }
    Ok(())
}

/// Exports the allocation that holds device pointer `ptr`: its device's
/// UUID, `cuIpcGetMemHandle` of its base, its base and size, and `ptr`'s
/// offset in it. A context must be current on the calling thread (any
/// context of the process: with unified addressing the driver finds the
/// allocation's device from the pointer).
///
/// Errors: [`CudaError::Unavailable`] without CUDA, [`CudaError::NoContext`],
/// [`CudaError::NotDevice`] for host memory or an unknown address,
/// [`CudaError::NotExportable`] for pool, `cuMemCreate` or managed memory.
pub fn export_memory(ptr: u64) -> Result<MemExport> {
    use sys::CUpointer_attribute as A;
    init()?;
    current_context()?;
    let not_device = |why: String| CudaError::NotDevice { ptr, why };
    let kind = match attribute(ptr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, 0u32) {
        Ok(k) => k,
        Err(sys::CUresult::CUDA_ERROR_INVALID_VALUE) => {
            return Err(not_device("CUDA does not know the address: pageable host memory?".into()))
        }
        Err(r) => return Err(CudaError::Driver { call: "cuPointerGetAttribute(MEMORY_TYPE)", result: r }),
    };
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Err(not_device(if kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
            "page-locked host memory".into()
        } else {
            format!("memory type {kind}")
        }));
    }
    let not_exportable = |why: String| CudaError::NotExportable { ptr, why };
    if attribute(ptr, A::CU_POINTER_ATTRIBUTE_IS_MANAGED, 0i32).unwrap_or(0) != 0 {
        return Err(not_exportable("managed memory (cuMemAllocManaged)".into()));
    }
    let pool = attribute(ptr, A::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, std::ptr::null_mut::<std::ffi::c_void>());
    if pool.is_ok_and(|p| !p.is_null()) {
        return Err(not_exportable(
            "it comes from a stream-ordered memory pool (cuMemAllocAsync; cudarc's alloc_zeros on GPUs with memory pools)"
                .into(),
        ));
    }
    if attribute(ptr, A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, 1i32).is_ok_and(|c| c == 0) {
        return Err(not_exportable("the driver says it is not IPC capable (memory from cuMemCreate?)".into()));
    }
    let ordinal = attribute(ptr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, -1i32)
        .map_err(|r| CudaError::Driver { call: "cuPointerGetAttribute(DEVICE_ORDINAL)", result: r })?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: writes a device address and a size through valid pointers;
    // `ptr` is device memory the driver knows (checked above).
    check("cuMemGetAddressRange_v2", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) })?;
    let mut h = sys::CUipcMemHandle { reserved: [0; HANDLE_LEN] };
    // SAFETY: writes one handle through a valid pointer; `base` is the
    // first byte of a live allocation (cuMemGetAddressRange just said so).
    let r = unsafe { sys::cuIpcGetMemHandle(&mut h, base) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(not_exportable(format!("cuIpcGetMemHandle: {r:?}")));
    }
    Ok(MemExport {
        uuid: device_uuid(usize::try_from(ordinal).unwrap_or(usize::MAX))?,
        handle: h.reserved.map(|b| b as u8),
        base,
        size: size as u64,
        offset: ptr - base,
    })
}

/// An interprocess CUDA event (`CU_EVENT_INTERPROCESS |
/// CU_EVENT_DISABLE_TIMING`) of one context, for the `EVENTS` flag of
/// region requests: register it with hkvd (`Client::register_cuda_event`),
/// record it on the stream that wrote a request's inputs, or make a stream
/// wait on it for a request's outputs. Destroyed on drop.
pub struct IpcEvent {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
    handle: [u8; HANDLE_LEN],
    uuid: [u8; UUID_LEN],
}

// SAFETY: a CUevent is a driver handle, usable from any thread whose
// current context is the event's (every method binds it first); the
// driver serialises calls on it.
unsafe impl Send for IpcEvent {}
// SAFETY: as for Send; no method hands out the handle mutably.
unsafe impl Sync for IpcEvent {}

impl std::fmt::Debug for IpcEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcEvent").field("ordinal", &self.ctx.ordinal()).finish()
    }
}

impl IpcEvent {
    /// Creates an interprocess event in `ctx` (bound to the calling
    /// thread by this call).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<IpcEvent> {
        let uuid = device_uuid(ctx.ordinal())?;
        ctx.bind_to_thread().map_err(|e| CudaError::Driver { call: "cuCtxSetCurrent", result: e.0 })?;
        let flags =
            sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32 | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle through a valid pointer, in the
        // context bound just above.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
        let mut h = sys::CUipcEventHandle { reserved: [0; HANDLE_LEN] };
        // SAFETY: `event` was just created with CU_EVENT_INTERPROCESS; the
        // handle is written through a valid pointer.
        let r = unsafe { sys::cuIpcGetEventHandle(&mut h, event) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: the event created above, destroyed once, unused since.
            unsafe { sys::cuEventDestroy_v2(event) };
            return Err(CudaError::Driver { call: "cuIpcGetEventHandle", result: r });
        }
        Ok(IpcEvent { ctx: ctx.clone(), event, handle: h.reserved.map(|b| b as u8), uuid })
    }

    /// `cuIpcGetEventHandle` of the event, as register_cuda_event sends it.
    pub fn handle(&self) -> [u8; HANDLE_LEN] {
        self.handle
    }

    /// `cuDeviceGetUuid_v2` of the event's device.
    pub fn uuid(&self) -> [u8; UUID_LEN] {
        self.uuid
    }

    /// The context the event belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn same_context(&self, stream: &CudaStream) -> Result<()> {
        if stream.context() != &self.ctx {
            return Err(CudaError::Invalid("the stream belongs to another context than the event".into()));
        }
        self.ctx.bind_to_thread().map_err(|e| CudaError::Driver { call: "cuCtxSetCurrent", result: e.0 })
    }

    /// Records the work enqueued on `stream` so far (`cuEventRecord`): a
    /// wait on the event, in this process or the daemon, waits for it.
    /// Then submits the stream's pending work (`cuStreamQuery`): the
    /// daemon asks the event from the host (`cuEventQuery`), and on the
    /// H200 it found a record still in this process's queue, not yet
    /// submitted, complete, and read a request's keys before they were
    /// written.
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        self.same_context(stream)?;
        // SAFETY: the event and the stream are live handles of the context
        // bound just above.
        check("cuEventRecord", unsafe { sys::cuEventRecord(self.event, stream.cu_stream()) })?;
        // SAFETY: a live stream of the bound context; only asks.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_NOT_READY => Ok(()),
            r => check("cuStreamQuery", r),
        }
    }

    /// Makes `stream` wait, on the GPU, for the last record of the event
    /// made before this call (`cuStreamWaitEvent`), whichever process made it.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        self.same_context(stream)?;
        // SAFETY: as in `record`; flags 0 is the default wait.
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), self.event, 0) })
    }

    /// Blocks the calling thread until the event's last record is done.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| CudaError::Driver { call: "cuCtxSetCurrent", result: e.0 })?;
        // SAFETY: a live event of the bound context.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.event) })
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the event created in `new`, destroyed once; the driver
        // defers the release until recorded work on it is done.
        let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

/// Device memory that [`export_memory`] can export: one `cuMemAlloc`
/// allocation, zeroed, freed on drop (after the context's work is done).
/// Copies in and out go through a stream of its context.
pub struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for DeviceAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceAlloc").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

impl DeviceAlloc {
    /// Allocates `len` bytes (at least 1) on `ctx`'s device with
    /// `cuMemAlloc`, zeroed; binds `ctx` to the calling thread.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<DeviceAlloc> {
        init()?;
        ctx.bind_to_thread().map_err(|e| CudaError::Driver { call: "cuCtxSetCurrent", result: e.0 })?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one device address through a valid pointer, in the
        // context bound above.
        check("cuMemAlloc_v2", unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) })?;
        let a = DeviceAlloc { ctx: ctx.clone(), ptr, len: len.max(1) };
        // SAFETY: [ptr, ptr + len) is the allocation just made; the memset
        // writes nothing else.
        check("cuMemsetD8_v2", unsafe { sys::cuMemsetD8_v2(ptr, 0, a.len) })?;
        // A memset of device memory returns before it ran (it is queued on
        // the legacy stream, which a non-blocking stream does not wait
        // for): without this, a copy into the allocation on such a stream
        // could run first and be zeroed after.
        // SAFETY: no arguments; waits for the bound context's work.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        Ok(a)
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The context it was allocated in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Checks `[offset, offset + bytes)` against the allocation and the
    /// stream's context, and binds the context.
    fn range(&self, stream: &CudaStream, offset: u64, bytes: usize) -> Result<u64> {
        if stream.context() != &self.ctx {
            return Err(CudaError::Invalid("the stream belongs to another context than the allocation".into()));
        }
        if offset.checked_add(bytes as u64).is_none_or(|end| end > self.len as u64) {
            return Err(CudaError::Invalid(format!(
                "bytes {offset}..+{bytes} lie outside the {}-byte device allocation",
                self.len
            )));
        }
        self.ctx.bind_to_thread().map_err(|e| CudaError::Driver { call: "cuCtxSetCurrent", result: e.0 })?;
        Ok(self.ptr + offset)
    }

    fn sync(stream: &CudaStream) -> Result<()> {
        // SAFETY: a live stream of the bound context.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream.cu_stream()) })
    }

    /// Copies `src` to byte `offset`, in `stream`'s order (after the work
    /// enqueued on it), and waits for the copy.
    pub fn write<T: IntoBytes + Immutable>(&self, stream: &CudaStream, offset: u64, src: &[T]) -> Result<()> {
        let bytes = src.as_bytes();
        let dst = self.range(stream, offset, bytes.len())?;
        // SAFETY: the destination lies within this allocation (checked);
        // the source is `bytes`, borrowed until the stream is synchronised
        // below, before this function returns.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, bytes.as_ptr().cast(), bytes.len(), stream.cu_stream())
        })?;
        Self::sync(stream)
    }

    /// Copies from byte `offset` into `dst`, in `stream`'s order (after the
    /// work enqueued on it, waits on events included), and waits for the copy.
    pub fn read<T: FromBytes + IntoBytes>(&self, stream: &CudaStream, offset: u64, dst: &mut [T]) -> Result<()> {
        let out = dst.as_mut_bytes();
        let src = self.range(stream, offset, out.len())?;
        // SAFETY: the source lies within this allocation (checked); `out`
        // is borrowed mutably until the stream is synchronised below. Any
        // bytes are a valid T (FromBytes), whatever another process wrote.
        check("cuMemcpyDtoHAsync_v2", unsafe {
            sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, out.len(), stream.cu_stream())
        })?;
        Self::sync(stream)
    }

    /// Enqueues on `stream` a wait until the `u32` at byte `offset` is not
    /// zero (`cuStreamWaitValue32`): work enqueued after it, an event
    /// record included, waits until another stream writes the word. A
    /// client's stall made on purpose, for tests of what a stalled or dead
    /// client costs the daemon; does not wait.
    pub fn gate(&self, stream: &CudaStream, offset: u64) -> Result<()> {
        if !offset.is_multiple_of(4) {
            return Err(CudaError::Invalid(format!("gate at byte {offset}: not a multiple of 4")));
        }
        let at = self.range(stream, offset, 4)?;
        // SAFETY: a live stream of the bound context; the word lies within
        // this allocation, which outlives the enqueued wait (drop
        // synchronises the context before freeing). Flags 0 =
        // CU_STREAM_WAIT_VALUE_GEQ: wait until the word is at least 1.
        check("cuStreamWaitValue32", unsafe { sys::cuStreamWaitValue32_v2(stream.cu_stream(), at, 1, 0) })
    }

    /// Enqueues on `stream` a fill of `bytes` bytes at `offset` with
    /// `value`; does not wait.
    pub fn fill(&self, stream: &CudaStream, offset: u64, bytes: usize, value: u8) -> Result<()> {
        let dst = self.range(stream, offset, bytes)?;
        // SAFETY: the range lies within this allocation, which outlives the
        // enqueued work (drop synchronises the context before freeing).
        check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(dst, value, bytes, stream.cu_stream()) })
    }

    /// Enqueues on `stream` a copy of `bytes` bytes from `src` (at
    /// `src_offset`) to byte `offset` of this allocation; does not wait.
    pub fn copy_from(
        &self,
        stream: &CudaStream,
        offset: u64,
        src: &DeviceAlloc,
        src_offset: u64,
        bytes: usize,
    ) -> Result<()> {
        let from = src.range(stream, src_offset, bytes)?;
        let to = self.range(stream, offset, bytes)?;
        // SAFETY: both ranges lie within live allocations of the stream's
        // context (checked), which outlive the enqueued copy (each one's
        // drop synchronises the context before freeing).
        check("cuMemcpyDtoDAsync_v2", unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, bytes, stream.cu_stream()) })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: waits for every stream of the context (copies and fills
        // into this allocation enqueued by its methods), then frees the
        // allocation made in `new`, once.
        unsafe {
            let _ = sys::cuCtxSynchronize();
            let _ = sys::cuMemFree_v2(self.ptr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver library every call says why, instead of panicking.
    #[test]
    fn without_cuda_every_call_says_unavailable() {
        // SAFETY: only tries to load the library.
        if unsafe { sys::is_culib_present() } {
            return;
        }
        assert!(matches!(available(), Err(CudaError::Unavailable(_))));
        assert!(matches!(export_memory(0x1000), Err(CudaError::Unavailable(_))));
        assert!(matches!(device_uuid(0), Err(CudaError::Unavailable(_))));
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn exports_name_the_allocation_and_refuse_what_does_not_export() {
        let ctx = CudaContext::new(0).unwrap();
        let a = DeviceAlloc::new(&ctx, 1 << 20).unwrap();
        let e = export_memory(a.ptr() + 4096).unwrap();
        assert_eq!((e.base, e.offset), (a.ptr(), 4096));
        assert!(e.size >= 1 << 20);
        assert_eq!(e.uuid, device_uuid(0).unwrap());
        assert_eq!(e.uuid, ctx.uuid().unwrap().bytes.map(|b| b as u8));
        assert_ne!(e.handle, [0; HANDLE_LEN]);
        // Host memory.
        let v = vec![0u8; 4096];
        assert!(matches!(export_memory(v.as_ptr() as u64), Err(CudaError::NotDevice { .. })));
        // A pool allocation (cudarc's alloc on GPUs with memory pools).
        let stream = ctx.new_stream().unwrap();
        if ctx.has_async_alloc() {
            use cudarc::driver::DevicePtr;
            let s = stream.alloc_zeros::<u8>(4096).unwrap();
            let (p, _sync) = s.device_ptr(&stream);
            let err = export_memory(p).unwrap_err();
            assert!(matches!(err, CudaError::NotExportable { .. }), "{err}");
        }
        // Copies in and out, bounds checked.
        a.write(&stream, 8, &[1u64, 2, 3]).unwrap();
        let mut back = [0u64; 3];
        a.read(&stream, 8, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3]);
        assert!(a.write(&stream, (1 << 20) - 8, &[1u64, 2]).is_err());
        // Events.
        let ev = IpcEvent::new(&ctx).unwrap();
        assert_ne!(ev.handle(), [0; HANDLE_LEN]);
        assert_eq!(ev.uuid(), e.uuid);
        a.fill(&stream, 0, 1 << 20, 7).unwrap();
        ev.record(&stream).unwrap();
        let other = ctx.new_stream().unwrap();
        ev.wait_on(&other).unwrap();
        let mut b = [0u8; 16];
        a.read(&other, 0, &mut b).unwrap();
        assert_eq!(b, [7; 16]);
        ev.synchronize().unwrap();
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// What the daemon does with an export, in another process: the handle
    /// opens there, the offset names the bytes written here, writes there
    /// are seen here, and the event handle opens and records.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn exported_memory_and_events_open_in_another_process() {
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let a = DeviceAlloc::new(&ctx, 1 << 20).unwrap();
        a.write(&stream, 4096, &[11u64, 22, 33, 44]).unwrap();
        let e = export_memory(a.ptr() + 4096).unwrap();
        let ev = IpcEvent::new(&ctx).unwrap();
        // The handles travel in a file the child finds by this process's
        // id (the library reads no environment, not even in its tests).
        let handles = child_handles(std::process::id());
        std::fs::write(&handles, format!("{} {} {}", hex(&e.handle), hex(&ev.handle()), e.offset)).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "cuda::tests::child_opens_the_handles", "--ignored", "--nocapture"])
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&handles);
        assert!(
            out.status.success(),
            "child: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ev.wait_on(&stream).unwrap();
        let mut back = [0u64; 4];
        a.read(&stream, 4096, &mut back).unwrap();
        assert_eq!(back, [11, 22, 33, 99], "the child's write is not seen here");
    }

    /// Where `exported_memory_and_events_open_in_another_process`, run as
    /// process `pid`, leaves its handles for its child.
    fn child_handles(pid: u32) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("hkv-region-ipc-test-{pid}"))
    }

    /// The other process of `exported_memory_and_events_open_in_another_process`.
    #[test]
    #[ignore = "run as a child process by exported_memory_and_events_open_in_another_process"]
    fn child_opens_the_handles() {
        let Ok(handles) = std::fs::read_to_string(child_handles(std::os::unix::process::parent_id())) else { return };
        let [mem, event, offset] = handles.split(' ').collect::<Vec<_>>()[..] else { panic!("{handles:?}") };
        let offset: u64 = offset.parse().unwrap();
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let mut h = sys::CUipcMemHandle { reserved: [0; HANDLE_LEN] };
        for (d, s) in h.reserved.iter_mut().zip(unhex(mem)) {
            *d = s as _;
        }
        let mut base: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: writes one device address; the handle is another process's export.
        check("cuIpcOpenMemHandle_v2", unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, h, flags) }).unwrap();
        let mut got = [0u64; 4];
        // SAFETY: 32 bytes at `offset` of the opened allocation (the
        // exporter wrote them) into a local array.
        check("cuMemcpyDtoH_v2", unsafe { sys::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), base + offset, 32) }).unwrap();
        assert_eq!(got, [11, 22, 33, 44]);
        // SAFETY: 8 bytes within the opened allocation, from a local.
        check("cuMemcpyHtoD_v2", unsafe { sys::cuMemcpyHtoD_v2(base + offset + 24, [99u64].as_ptr().cast(), 8) })
            .unwrap();
        let mut eh = sys::CUipcEventHandle { reserved: [0; HANDLE_LEN] };
        for (d, s) in eh.reserved.iter_mut().zip(unhex(event)) {
            *d = s as _;
        }
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; the handle is another process's export.
        check("cuIpcOpenEventHandle", unsafe { sys::cuIpcOpenEventHandle(&mut event, eh) }).unwrap();
        // SAFETY: a live event and stream of the bound context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event, stream.cu_stream()) }).unwrap();
        stream.synchronize().unwrap();
        // SAFETY: the mapping opened above, closed once, no copy pending.
        check("cuIpcCloseMemHandle", unsafe { sys::cuIpcCloseMemHandle(base) }).unwrap();
    }
}
