//! CUDA IPC, the importing side: device memory and events of another
//! process (a client of the daemon), opened once from their IPC handles and
//! closed on drop.
//!
//! - [`IpcMem`]: `cuIpcOpenMemHandle` of a client's allocation, in the
//!   context of the GPU it lives on; byte copies in and out for the paths
//!   that stage, and checked [`IpcMem::span`]s that the table's kernels
//!   read and write in place ([`crate::cuda::table::CudaTable::run_ipc`]).
//! - [`IpcEvent`]: `cuIpcOpenEventHandle` of a client's interprocess event,
//!   waited on by a stream (or the host) and recorded.
//! - [`device_uuid`], [`ordinal_of_uuid`]: GPUs are named by UUID across
//!   processes, since ordinals depend on each process's
//!   `CUDA_VISIBLE_DEVICES`.

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream, DeviceRepr};

use super::{dev_err, shared_device, DevPtr, Device};
use crate::error::{Error, Result};

/// Bytes of an IPC handle.
pub use hkv_region::cuda::HANDLE_LEN;

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Device(format!("{what} failed ({r:?})")))
    }
}

/// The UUID of device `ordinal` (`cuDeviceGetUuid`), as clients name it
/// (`hkv_region::cuda::device_uuid`, the same call both sides make).
pub fn device_uuid(ordinal: usize) -> Result<[u8; 16]> {
    hkv_region::cuda::device_uuid(ordinal).map_err(|e| Error::Device(e.to_string()))
}

/// Which of `ordinals` has UUID `uuid`.
pub fn ordinal_of_uuid(uuid: &[u8; 16], ordinals: &[usize]) -> Option<usize> {
    ordinals.iter().copied().find(|&o| device_uuid(o).is_ok_and(|u| &u == uuid))
}

/// Formats a UUID as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (nvidia-smi's form).
pub fn uuid_string(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// A bare context of device `ordinal` for [`check_handle`] (no kernels
/// loaded), made once per process.
fn bare_context(ordinal: usize) -> Result<Arc<cudarc::driver::CudaContext>> {
    static CONTEXTS: parking_lot::Mutex<Vec<(usize, Arc<cudarc::driver::CudaContext>)>> =
        parking_lot::Mutex::new(Vec::new());
    let mut all = CONTEXTS.lock();
    if let Some((_, c)) = all.iter().find(|(o, _)| *o == ordinal) {
        return Ok(c.clone());
    }
    if !super::device::driver_present() {
        return Err(Error::Unavailable("no CUDA driver library (libcuda.so) on this host".into()));
    }
    let c = cudarc::driver::CudaContext::new(ordinal).map_err(dev_err("creating a context"))?;
    all.push((ordinal, c.clone()));
    Ok(c)
}

/// `cuIpcOpenMemHandle` of `handle` in the bound context, with lazy peer
/// access: the mapped address, or the driver's result.
///
/// # Safety
/// A context is bound to this thread; the caller closes the mapping once.
unsafe fn open_mem_handle(handle: &[u8; HANDLE_LEN]) -> std::result::Result<sys::CUdeviceptr, sys::CUresult> {
    let h = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
    let mut ptr: sys::CUdeviceptr = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: writes one device pointer; the driver reads the bytes (a bad
    // handle is an error result, or worse: see `check_handle`).
    match unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) } {
        sys::CUresult::CUDA_SUCCESS => Ok(ptr),
        r => Err(r),
    }
}

/// Checks that the allocation mapped at `ptr` (in the bound context) holds
/// `len` bytes from there.
fn check_holds(ptr: sys::CUdeviceptr, len: u64) -> Result<()> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: writes a base address and a size about an address mapped
    // while the caller holds it.
    check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }, "cuMemGetAddressRange")?;
    let avail = (base + size as u64).saturating_sub(ptr);
    if ptr < base || len > avail {
        return Err(Error::Config(format!("{len} bytes asked for, the allocation holds {avail}")));
    }
    Ok(())
}

/// Why [`check_handle`] refused a handle.
#[derive(Debug)]
pub struct Refused {
    /// In words, for the client.
    pub why: String,
    /// Whether this process's context on that device is lost (an access
    /// through the mapping faulted, which the driver does not undo): the
    /// process should check no more handles.
    pub context_lost: bool,
}

/// Opens `handle` on device `ordinal`, proves the memory readable, and
/// closes it again: a memory handle (`len: Some`: the allocation must hold
/// `len` bytes from its mapped address, and every one of them is read, on
/// the device, into a scratch buffer) or an event handle (`len: None`).
/// For a process whose only job is this check (the daemon's handle
/// checker): the driver's open itself can kill the process on some altered
/// handles, and some altered handles open to a mapping whose access faults,
/// which loses the context of every user of that device in the process;
/// no check short of these can tell. Uses a bare context, no kernels, and
/// none of this module's shared mappings.
pub fn check_handle(ordinal: usize, handle: &[u8; HANDLE_LEN], len: Option<u64>) -> std::result::Result<(), Refused> {
    let refused = |why: String| Refused { why, context_lost: false };
    let ctx = bare_context(ordinal).map_err(|e| refused(e.to_string()))?;
    ctx.bind_to_thread().map_err(|e| refused(format!("binding the device's context: {e:?}")))?;
    let Some(len) = len else {
        let h = sys::CUipcEventHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; the driver reads the bytes.
        check(unsafe { sys::cuIpcOpenEventHandle(&mut ev, h) }, "cuIpcOpenEventHandle")
            .map_err(|e| refused(e.to_string()))?;
        // SAFETY: the event just opened, destroyed once.
        return check(unsafe { sys::cuEventDestroy_v2(ev) }, "cuEventDestroy").map_err(|e| refused(e.to_string()));
    };
    // SAFETY: the bare context is bound above; closed once below.
    let ptr = unsafe { open_mem_handle(handle) }.map_err(|r| refused(format!("cuIpcOpenMemHandle failed ({r:?})")))?;
    let mut verdict = check_holds(ptr, len).map_err(|e| refused(e.to_string()));
    if verdict.is_ok() {
        verdict = read_through(ptr, len).map_err(|e| Refused {
            why: format!("reading the {len} bytes through the handle failed ({e}): it maps no memory of that size"),
            context_lost: true,
        });
    }
    // SAFETY: the mapping opened above, closed once; every copy from it
    // was synchronised (or the context is lost).
    let closed = check(unsafe { sys::cuIpcCloseMemHandle(ptr) }, "cuIpcCloseMemHandle");
    verdict?;
    closed.map_err(|e| refused(e.to_string()))
}

/// Copies `len` bytes from `ptr` into a scratch buffer on the device, piece
/// by piece, and waits for the copies (the bound context's).
fn read_through(ptr: sys::CUdeviceptr, len: u64) -> Result<()> {
    const PIECE: u64 = 64 << 20;
    let mut scratch: sys::CUdeviceptr = 0;
    // SAFETY: writes one device address.
    check(unsafe { sys::cuMemAlloc_v2(&mut scratch, PIECE.min(len) as usize) }, "cuMemAlloc")?;
    let mut at = 0;
    let mut r = Ok(());
    while at < len && r.is_ok() {
        let n = PIECE.min(len - at);
        // SAFETY: `scratch` holds PIECE.min(len) ≥ n bytes; the source
        // range lies in the mapping, within the size the driver reported.
        r = check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(scratch, ptr + at, n as usize, std::ptr::null_mut()) },
            "cuMemcpyDtoD",
        );
        at += n;
    }
    // SAFETY: no arguments; waits for the context's work.
    let synced = check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize");
    // SAFETY: the scratch buffer allocated above, no copy pending.
    let _ = unsafe { sys::cuMemFree_v2(scratch) };
    r.and(synced)
}

/// A client's allocation as this process has it mapped: opened once per
/// distinct handle, shared by every registration of that handle, closed
/// when the last goes.
struct Opened {
    dev: Arc<Device>,
    ordinal: usize,
    /// The allocation's address in this process.
    ptr: u64,
    /// The handle it was opened from.
    handle: [u8; HANDLE_LEN],
    /// Whether kernels on another GPU reach it (peer access), by ordinal,
    /// once asked.
    peers: parking_lot::Mutex<Vec<(usize, bool)>>,
}

/// Every allocation this process has open, by (GPU, handle bytes) and by
/// (GPU, address). The lock is held around each open and close: one
/// allocation registered through many copies of its handle (fuzzed ones
/// among them) from several connections at once corrupted the daemon's
/// heap ("malloc(): unsorted double linked list corrupted") when each
/// registration opened and closed the handle by itself, concurrently. Now a
/// handle already open is shared, not opened again; a different handle
/// that maps to an address already open shares that mapping too, and its
/// extra open is never closed (a leaked reference at worst, never a second
/// close of one mapping).
static OPEN: parking_lot::Mutex<Vec<std::sync::Weak<Opened>>> = parking_lot::Mutex::new(Vec::new());

impl Drop for Opened {
    fn drop(&mut self) {
        let mut open = OPEN.lock();
        open.retain(|w| w.strong_count() > 0);
        let _ = self.dev.ctx.bind_to_thread();
        // SAFETY: the address cuIpcOpenMemHandle gave, closed once (the last
        // holder of the one `Opened` for it); every span holds an Arc of its
        // IpcMem, so no kernel is given it afterwards (their streams were
        // synchronised before the spans dropped).
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        drop(open);
    }
}

/// A client's device allocation registered in this process: its mapping
/// (shared with every other registration of it) and the bytes registered.
pub struct IpcMem {
    map: Arc<Opened>,
    /// Bytes registered (at most the allocation's).
    len: u64,
}

impl std::fmt::Debug for IpcMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcMem(gpu {}, {:#x}, {} bytes)", self.map.ordinal, self.map.ptr, self.len)
    }
}

impl IpcMem {
    /// Opens `handle` (a `CUipcMemHandle`) in device `ordinal`'s context and
    /// checks that the allocation holds `len` bytes at least.
    pub fn open(ordinal: usize, handle: &[u8; HANDLE_LEN], len: u64) -> Result<IpcMem> {
        if len == 0 {
            return Err(Error::Config("0 bytes to register".into()));
        }
        let dev = shared_device(ordinal)?;
        // Declared before the lock, so dropped after it on every path (see below).
        let live: Vec<Arc<Opened>>;
        let mut open = OPEN.lock();
        open.retain(|w| w.strong_count() > 0);
        let same =
            |o: &Opened, ptr: Option<u64>| o.ordinal == ordinal && ptr.map_or(o.handle == *handle, |p| o.ptr == p);
        // Upgraded into a list dropped only after the lock is released: the
        // last holder of one of them dropping it here would close it under
        // the lock, which its drop takes again.
        live = open.iter().filter_map(std::sync::Weak::upgrade).collect();
        let known = live.iter().find(|o| same(o, None)).cloned();
        let map = match known {
            Some(m) => m,
            None => {
                dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
                // SAFETY: the device's context is bound above; no other open
                // or close of this process runs meanwhile (`OPEN` held); the
                // mapping is closed once, by the last holder of its `Opened`.
                let ptr = match unsafe { open_mem_handle(handle) } {
                    Ok(p) => p,
                    Err(r) => {
                        return Err(Error::Device(format!(
                            "the IPC handle does not open ({r:?}): it must come from cuIpcGetMemHandle of a live \
                         allocation made with cudaMalloc / cuMemAlloc by another process on this host (memory from \
                         cuMemCreate, freed memory and the daemon's own cannot be opened)"
                        )))
                    }
                };
                match live.iter().find(|o| same(o, Some(ptr))) {
                    // Another handle of an allocation already open: share
                    // that mapping; this open's reference is left open.
                    Some(m) => m.clone(),
                    None => {
                        let m = Arc::new(Opened {
                            dev: dev.clone(),
                            ordinal,
                            ptr,
                            handle: *handle,
                            peers: parking_lot::Mutex::new(Vec::new()),
                        });
                        open.push(Arc::downgrade(&m));
                        m
                    }
                }
            }
        };
        drop(open);
        drop(live);
        let mem = IpcMem { map, len };
        mem.map.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        check_holds(mem.map.ptr, len)?;
        Ok(mem)
    }

    /// Whether kernels on GPU `ordinal` can read and write this memory: its
    /// own GPU, or another with peer access to it, which this enables (in
    /// `ordinal`'s context, towards this memory's; the handle was opened
    /// with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, so the mapping follows).
    /// Asked of the driver once per GPU.
    pub fn reachable_from(&self, ordinal: usize) -> bool {
        if ordinal == self.map.ordinal {
            return true;
        }
        if let Some(&(_, ok)) = self.map.peers.lock().iter().find(|(o, _)| *o == ordinal) {
            return ok;
        }
        let ok = self.enable_peer(ordinal).is_ok();
        self.map.peers.lock().push((ordinal, ok));
        ok
    }

    fn enable_peer(&self, ordinal: usize) -> Result<()> {
        let other = shared_device(ordinal)?;
        let mut can = 0;
        // SAFETY: both are devices of an initialised driver; `can` is a
        // local out-parameter.
        check(
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, other.ctx.cu_device(), self.map.dev.ctx.cu_device()) },
            "cuDeviceCanAccessPeer",
        )?;
        if can == 0 {
            return Err(Error::Device(format!("GPU {ordinal} has no peer access to GPU {}", self.map.ordinal)));
        }
        other.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        // SAFETY: `other`'s context is current; this memory's context lives
        // as long as its shared device (held by `self.map.dev`).
        let r = unsafe { sys::cuCtxEnablePeerAccess(self.map.dev.ctx.cu_ctx(), 0) };
        if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Err(Error::Device(format!("cuCtxEnablePeerAccess failed ({r:?})")));
        }
        Ok(())
    }

    /// Its address in this process.
    pub(crate) fn addr(&self) -> u64 {
        self.map.ptr
    }

    /// The GPU it lives on.
    pub fn ordinal(&self) -> usize {
        self.map.ordinal
    }

    /// Bytes registered.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether no byte is registered (never: [`IpcMem::open`] refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range<T>(&self, offset: u64, count: u64) -> Result<u64> {
        let size = std::mem::size_of::<T>() as u64;
        let end = count.checked_mul(size).and_then(|b| offset.checked_add(b));
        match end {
            Some(e) if e <= self.len && offset.is_multiple_of(size.max(1)) => Ok(self.map.ptr + offset),
            _ => Err(Error::Config(format!(
                "{count} elements of {size} bytes at byte {offset} are not inside the {}-byte region, aligned",
                self.len
            ))),
        }
    }

    /// `count` elements of `T` from byte `offset`, checked against the
    /// region; kernels given the span reach the client's memory in place.
    pub fn span<T>(self: &Arc<Self>, offset: u64, count: u64) -> Result<IpcSpan<T>> {
        let addr = self.range::<T>(offset, count)?;
        let len = usize::try_from(count).map_err(|_| Error::Config(format!("{count} elements")))?;
        Ok(IpcSpan { mem: self.clone(), ptr: DevPtr::from_raw(addr, len) })
    }

    /// Copies `dst.len()` elements from byte `offset` into `dst` (waits).
    pub fn read<T: DeviceRepr>(&self, offset: u64, dst: &mut [T]) -> Result<()> {
        let src = self.range::<T>(offset, dst.len() as u64)?;
        self.map.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        let bytes = std::mem::size_of_val(dst);
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `src` is `bytes` bytes inside the opened allocation
        // (checked); `dst` is this process's memory of that size. The copy
        // is synchronous, so `dst` is not touched after the call.
        check(unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, bytes) }, "copying from a CUDA region")
    }

    /// Copies `src` to byte `offset` (waits).
    pub fn write<T: DeviceRepr>(&self, offset: u64, src: &[T]) -> Result<()> {
        let dst = self.range::<T>(offset, src.len() as u64)?;
        self.map.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        let bytes = std::mem::size_of_val(src);
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `dst` is `bytes` bytes inside the opened allocation
        // (checked); the copy is synchronous.
        check(unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), bytes) }, "copying to a CUDA region")
    }
}

/// Elements of `T` in an [`IpcMem`], bounds checked; keeps it open.
pub struct IpcSpan<T> {
    mem: Arc<IpcMem>,
    ptr: DevPtr<T>,
}

impl<T> Clone for IpcSpan<T> {
    fn clone(&self) -> Self {
        IpcSpan { mem: self.mem.clone(), ptr: self.ptr }
    }
}

impl<T> IpcSpan<T> {
    /// The region it lies in.
    pub fn mem(&self) -> &Arc<IpcMem> {
        &self.mem
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.ptr.len()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.ptr.len() == 0
    }

    pub(crate) fn ptr(&self) -> DevPtr<T> {
        self.ptr
    }
}

/// A client's interprocess event opened in this process.
pub struct IpcEvent {
    dev: Arc<Device>,
    ev: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread whose
// context is bound (every use binds it); the driver synchronises it.
unsafe impl Send for IpcEvent {}
// SAFETY: as for Send; no method mutates Rust state.
unsafe impl Sync for IpcEvent {}

impl std::fmt::Debug for IpcEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcEvent(gpu {})", self.dev.info.ordinal)
    }
}

impl IpcEvent {
    /// Opens `handle` (a `CUipcEventHandle`) in device `ordinal`'s context.
    pub fn open(ordinal: usize, handle: &[u8; HANDLE_LEN]) -> Result<IpcEvent> {
        let dev = shared_device(ordinal)?;
        dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        let h = sys::CUipcEventHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; the driver validates the bytes.
        let r = unsafe { sys::cuIpcOpenEventHandle(&mut ev, h) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::Device(format!(
                "the IPC event handle does not open ({r:?}): it must come from cuIpcGetEventHandle of an event \
                 created with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING by another process on this host"
            )));
        }
        Ok(IpcEvent { dev, ev })
    }

    /// Makes `s` wait for the event's last record (on the GPU).
    pub fn wait_on(&self, s: &CudaStream) -> Result<()> {
        // SAFETY: both handles are live (the event until drop, the stream borrowed).
        check(unsafe { sys::cuStreamWaitEvent(s.cu_stream(), self.ev, 0) }, "cuStreamWaitEvent")
    }

    /// Whether the work of the event's last record is done (or it was
    /// never recorded), asked without waiting: a client that died before
    /// its record ran leaves this false for good, so a caller polls with
    /// a deadline instead of making a stream wait (a stream wait cannot be
    /// undone, and it blocked every table on the device).
    pub fn query(&self) -> Result<bool> {
        self.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.ev) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(r, "cuEventQuery").map(|()| false),
        }
    }

    /// Records the event on `s`.
    pub fn record(&self, s: &CudaStream) -> Result<()> {
        // SAFETY: as in `wait_on`.
        check(unsafe { sys::cuEventRecord(self.ev, s.cu_stream()) }, "cuEventRecord")
    }

    /// Waits on this thread for the event's last record.
    pub fn wait_host(&self) -> Result<()> {
        self.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        // SAFETY: a live event.
        check(unsafe { sys::cuEventSynchronize(self.ev) }, "cuEventSynchronize")
    }

    /// Records the event on a stream of its device once everything queued
    /// there so far is done: after host-side copies (synchronous) it
    /// completes at once.
    pub fn record_now(&self) -> Result<()> {
        self.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        // SAFETY: the legacy default stream (null) of the bound context.
        check(unsafe { sys::cuEventRecord(self.ev, std::ptr::null_mut()) }, "cuEventRecord")
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        let _ = self.dev.ctx.bind_to_thread();
        // SAFETY: the event opened in `open`, destroyed once.
        let _ = unsafe { sys::cuEventDestroy_v2(self.ev) };
    }
}
