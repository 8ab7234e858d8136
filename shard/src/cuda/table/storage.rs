//! The table's device memory (and its pinned host tier), allocated and
//! cleared whole.

use super::*;

/// Bytes per host-tier slice (rounded down to a power of two of rows).
pub(super) const SLICE_BYTES: u64 = 1 << 30;

/// The table's device memory. The buffers are held for the raw addresses
/// in `args`, through which the kernels use them.
#[allow(dead_code)]
pub(super) struct Storage {
    pub(super) digests: CudaSlice<u8>,
    pub(super) keys: CudaSlice<u64>,
    pub(super) scores: CudaSlice<u64>,
    pub(super) sizes: CudaSlice<i32>,
    pub(super) locks: CudaSlice<i32>,
    pub(super) fast: Option<CudaSlice<f32>>,
    pub(super) host: Vec<PinnedHostSlice<f32>>,
    pub(super) _slice_ptrs: CudaSlice<u64>,
    pub(super) nbuckets: u64,
    pub(super) fast_slots: u64,
    pub(super) host_slots: u64,
    pub(super) args: TableArgs,
}

impl Storage {
    /// Allocates and clears storage of `nbuckets` buckets for `config` on
    /// `dev` (`clear`: the `clear_table` kernel), waiting for the clear.
    pub(super) fn new(
        dev: &Device,
        config: &TableConfig,
        clear: &CudaFunction,
        stream: &Arc<CudaStream>,
        nbuckets: u64,
    ) -> Result<Storage> {
        let dim = config.dim as u64;
        let slots = nbuckets * S;
        let row = dim * 4;
        let fast_slots = match config.fast_tier_bytes {
            Some(b) => (b / row).min(slots),
            None => slots,
        };
        let host_slots = slots - fast_slots;
        let al = |what: &'static str| alloc_err(what);
        let digests = stream.alloc_zeros::<u8>(slots as usize).map_err(al("allocating digests"))?;
        let keys = stream.alloc_zeros::<u64>(slots as usize).map_err(al("allocating keys"))?;
        let scores = stream.alloc_zeros::<u64>(slots as usize).map_err(al("allocating scores"))?;
        let sizes = stream.alloc_zeros::<i32>(nbuckets as usize).map_err(al("allocating bucket sizes"))?;
        let locks = stream.alloc_zeros::<i32>(nbuckets as usize).map_err(al("allocating bucket locks"))?;
        let fast = if fast_slots > 0 {
            Some(stream.alloc_zeros::<f32>((fast_slots * dim) as usize).map_err(al("allocating device values"))?)
        } else {
            None
        };
        // Host tier: slices of 2^shift rows, pinned and mapped into the device's address space.
        let mut shift = 0u32;
        while (2u64 << shift) * row <= SLICE_BYTES {
            shift += 1;
        }
        let per = 1u64 << shift;
        let mut host = vec![];
        let mut slice_ptrs = vec![];
        let mut left = host_slots;
        while left > 0 {
            let rows = left.min(per);
            let (h, dp) = host_slice(dev, (rows * dim) as usize)?;
            slice_ptrs.push(dp);
            host.push(h);
            left -= rows;
        }
        if slice_ptrs.is_empty() {
            slice_ptrs.push(0);
        }
        let dslices = stream.clone_htod(&slice_ptrs).map_err(al("copying slice pointers"))?;
        let args = TableArgs {
            digests: ptr(&digests, stream),
            keys: ptr(&keys, stream),
            scores: ptr(&scores, stream),
            sizes: ptr(&sizes, stream),
            locks: ptr(&locks, stream),
            fast: opt_ptr(&fast, stream),
            slices: ptr(&dslices, stream),
            fast_slots,
            nbuckets,
            slice_shift: shift,
            dim: dim as u32,
            dual: (config.mode == BucketMode::Dual) as u32,
            pad: 0,
            order: 0,
        };
        let st = Storage {
            digests,
            keys,
            scores,
            sizes,
            locks,
            fast,
            host,
            _slice_ptrs: dslices,
            nbuckets,
            fast_slots,
            host_slots,
            args,
        };
        let mut l = stream.launch_builder(clear);
        l.arg(&st.args);
        // SAFETY: clear_table(t) writes keys, digests and scores of positions
        // < nbuckets * 128 and sizes / locks of buckets < nbuckets, all inside
        // the buffers just allocated with exactly those lengths.
        unsafe { l.launch(blocks(slots)?) }.map_err(dev_err("launching clear_table"))?;
        stream.synchronize().map_err(dev_err("initialising the table"))?;
        Ok(st)
    }
}

/// One host-tier slice of `len` values (cuMemHostAlloc), zeroed and mapped
/// into the device's address space, and its device address.
pub(super) fn host_slice(dev: &Device, len: usize) -> Result<(PinnedHostSlice<f32>, u64)> {
    use cudarc::driver::sys;
    let al = |e| alloc_err("allocating pinned host values")(e);
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: the memory is zeroed right below before any use.
    let mut h = unsafe { dev.ctx.alloc_pinned_with_flags::<f32>(len, flags) }.map_err(al)?;
    let hp = h.as_mut_ptr().map_err(al)?;
    // SAFETY: hp points to len f32 just allocated and owned by `h`.
    unsafe { std::ptr::write_bytes(hp, 0, len) };
    let mut dp: sys::CUdeviceptr = 0;
    // SAFETY: hp was allocated by cuMemHostAlloc with DEVICEMAP in this
    // context; the call writes one device pointer to `dp`.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dp, hp as *mut _, 0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Device(format!("cuMemHostGetDevicePointer: {r:?}")));
    }
    Ok((h, dp))
}
