//! Page-locked host memory the GPU reads and writes directly, and what the
//! driver knows about a host pointer.

use super::*;

/// Page-locked host memory for a response frame that the GPU writes rows
/// into directly: a find of a CUDA table whose values array lies in such
/// memory copies the rows there from the device in one transfer, without
/// the lane's staging memory in between, and `CudaTable::find_at` has the
/// lookup kernel write rows into it over PCIe. Pinned and mapped for every
/// context (`CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`); zeroed
/// when allocated; freed on drop.
pub struct HostFrame {
    mem: cudarc::driver::PinnedHostSlice<u8>,
    /// `mem`'s address (fixed for its life).
    ptr: *mut u8,
    len: usize,
    /// The address kernels reach `ptr` through, asked of the driver once
    /// at allocation: with unified addressing (every platform CUDA runs
    /// 64-bit code on) portable host memory has the same address in every
    /// context, so it holds for every device's kernels. None where the
    /// driver gives none (the frame's rows then come through staging).
    device: Option<u64>,
}

/// Rows of f32 in a [`HostFrame`], which kernels can write directly: built
/// only by [`HostFrame::split_rows`], so that a find knows from the type
/// that its destination is page-locked and mapped, without asking the
/// driver about a pointer on every request.
pub struct PinnedRows<'a> {
    values: &'a mut [f32],
    /// `values`' address for kernels.
    device: u64,
}

impl<'a> PinnedRows<'a> {
    /// The rows, to read or write on the host.
    pub fn values(&mut self) -> &mut [f32] {
        self.values
    }

    /// The rows for the rest of the borrow.
    pub fn into_values(self) -> &'a mut [f32] {
        self.values
    }

    /// The same rows for a shorter borrow (to pass to one find and keep).
    pub fn reborrow(&mut self) -> PinnedRows<'_> {
        PinnedRows { values: self.values, device: self.device }
    }

    /// Floats.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Rows of a registered mapping ([`super::pin::HostPin`]).
    ///
    /// # Safety
    /// `values` must lie within host memory page-locked and device-mapped
    /// for every context (`PORTABLE | DEVICEMAP`) for at least the borrow,
    /// and `device` must be `values`' address for kernels.
    pub(super) unsafe fn registered(values: &'a mut [f32], device: u64) -> PinnedRows<'a> {
        PinnedRows { values, device }
    }

    /// The rows as kernels reach them.
    pub(crate) fn device(&self) -> DevPtr<f32> {
        DevPtr::from_raw(self.device, self.values.len())
    }
}

// SAFETY: the memory is owned by `mem` (itself Send + Sync) and reached
// only through &self / &mut self, so the usual borrow rules serialise it.
unsafe impl Send for HostFrame {}

// SAFETY: as above; &self gives read access only.
unsafe impl Sync for HostFrame {}

impl HostFrame {
    /// `bytes` zeroed bytes of pinned memory, allocated in device
    /// `ordinal`'s context.
    pub fn new(ordinal: usize, bytes: usize) -> Result<HostFrame> {
        let dev = shared_device(ordinal)?;
        let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE | cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: the memory is zeroed below before anything reads it.
        let mut mem = unsafe { dev.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), flags) }
            .map_err(dev_err("allocating a pinned frame"))?;
        let ptr = mem.as_mut_ptr().map_err(dev_err("a pinned frame"))?;
        // SAFETY: ptr points to at least `bytes` bytes just allocated, owned by `mem`.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        let device = device_address_of_host(ptr, bytes.max(1));
        Ok(HostFrame { mem, ptr, len: bytes, device })
    }

    /// The frame split at byte `at`: the bytes before it, and the bytes
    /// from it on as rows of f32 that kernels write directly. None when
    /// `at` or the length after it is no multiple of 4, `at` lies past the
    /// end, or the driver gave the frame no device address (the caller then
    /// uses [`HostFrame::bytes_mut`] as ordinary memory).
    pub fn split_rows(&mut self, at: usize) -> Option<(&mut [u8], PinnedRows<'_>)> {
        let device = self.device?;
        if !cfg!(target_endian = "little")
            || at > self.len
            || !at.is_multiple_of(4)
            || !(self.len - at).is_multiple_of(4)
        {
            return None;
        }
        let floats = (self.len - at) / 4;
        // SAFETY: `ptr` is page-aligned (a pinned allocation) and `at` a
        // multiple of 4, so `ptr + at` is aligned for f32; the `len` bytes
        // at `ptr` are allocated and initialised (see `bytes`) and every
        // bit pattern is an f32; the two slices do not overlap, and &mut
        // self makes them exclusive for their life.
        let (head, rows) = unsafe {
            (
                std::slice::from_raw_parts_mut(self.ptr, at),
                std::slice::from_raw_parts_mut(self.ptr.add(at) as *mut f32, floats),
            )
        };
        Some((head, PinnedRows { values: rows, device: device + at as u64 }))
    }

    /// The frame's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes at `ptr` are allocated (len <= capacity) and
        // initialised (zeroed at allocation, written only through &mut).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The frame's bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        self.mem.len()
    }

    /// Makes the frame `len` bytes, at most [`HostFrame::capacity`]; bytes
    /// that come into it keep what they held.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity(), "a pinned frame of {} bytes cannot hold {len}", self.capacity());
        self.len = len;
    }
}

impl Drop for HostFrame {
    /// The memory is freed through its context, which the dropping thread
    /// (a daemon's connection writer, say) may not have bound.
    fn drop(&mut self) {
        let _ = self.mem.context().bind_to_thread();
    }
}

/// Whether `bytes` bytes at `p` lie in page-locked host memory that CUDA
/// copies can reach directly (allocated or registered with the driver):
/// the first and the last byte are (a Rust slice lies in one allocation).
pub fn is_pinned_host(p: *const u8, bytes: usize) -> bool {
    use cudarc::driver::sys::{CUmemorytype, CUpointer_attribute};
    let pinned = |a: u64| {
        pointer_attribute::<u32>(a, CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
            == Some(CUmemorytype::CU_MEMORYTYPE_HOST as u32)
    };
    bytes > 0 && pinned(p as u64) && pinned(p as u64 + bytes as u64 - 1)
}

/// The address through which kernels of the thread's current context reach
/// the `bytes` bytes at `p`, when they lie in page-locked host memory mapped
/// for the device (as a [`HostFrame`] is); else `None`.
pub(super) fn device_address_of_host(p: *const u8, bytes: usize) -> Option<u64> {
    use cudarc::driver::sys::CUpointer_attribute;
    if !is_pinned_host(p, bytes) {
        return None;
    }
    pointer_attribute::<u64>(p as u64, CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER).filter(|&a| a != 0)
}

/// The driver's answer to a pointer attribute query about address `a`
/// (`T`: the attribute's type, u32 or u64), or None where it has none.
pub(super) fn pointer_attribute<T: Copy + Default>(
    a: u64,
    attr: cudarc::driver::sys::CUpointer_attribute,
) -> Option<T> {
    use cudarc::driver::sys;
    let mut v = T::default();
    // SAFETY: the call writes one value of the attribute's type, which the
    // callers give as `T`, into `v`; it only looks the address up, never
    // dereferences it.
    let r =
        unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut std::ffi::c_void, attr, a as sys::CUdeviceptr) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
}
