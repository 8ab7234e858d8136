//! Pinned staging memory for the host arrays of a CUDA batch.
//!
//! Every host array a batch hands to the device, or gets back, passes
//! through page-locked memory that the lane keeps from batch to batch, so
//! each array is one asynchronous DMA transfer, queued on the lane's stream
//! with the kernels. (From pageable memory the driver copies in pieces
//! through its own small buffers and waits for each transfer.)
//!
//! A batch takes regions one after the other: [`Staging::upload`] copies a
//! host array into the next region and queues its transfer to the device;
//! [`Staging::fetch`] queues a transfer from the device into the next
//! region, readable with [`Staging::read`] after [`Staging::sync`]. Regions
//! stay valid until [`Staging::reset`] at the end of the batch. A batch that
//! outgrows the buffer gets another one; the next batch starts with a
//! single buffer of the total, so a steady workload allocates nothing.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream, DeviceRepr, PinnedHostSlice};

use crate::cuda::dev_err;
use crate::error::Result;

/// Alignment of regions: a cache line, and the alignment of every element type.
const ALIGN: usize = 64;
/// The smallest buffer allocated (pinning memory costs a system call and page-table work).
const MIN_BUFFER: usize = 1 << 20;
/// Buffers above this size are freed at the end of their batch rather than
/// kept: a rare huge batch should not keep gigabytes of host memory locked.
const KEEP_BYTES: usize = 1 << 30;
/// Copies between host arrays and the staging buffer above this size are
/// split over threads: one core copies about 10 GB/s, a PCIe Gen5 x16 link
/// moves about 50.
const PARALLEL_COPY_BYTES: usize = 8 << 20;
const COPY_THREADS: usize = 8;

struct Buf {
    /// Owns the allocation (freed on drop).
    _mem: PinnedHostSlice<u8>,
    /// Its host address (kept as an integer so that lanes stay `Send`).
    addr: usize,
    len: usize,
}

/// A lane's staging memory; see the module docs.
pub(crate) struct Staging {
    ctx: Arc<CudaContext>,
    bufs: Vec<Buf>,
    /// Bytes handed out of the last buffer.
    used: usize,
    /// Bytes the next batch's first buffer gets (what the last batch needed).
    want: usize,
    /// Counts resets, so that a region of an earlier batch is never read.
    batch: u64,
    /// Transfers into regions queued since the last [`Staging::sync`].
    pending: bool,
    /// Transfers of either direction queued since the last [`Staging::sync`].
    queued: bool,
}

/// A region filled by [`Staging::fetch`]: `len` elements of `T`.
#[derive(Debug)]
pub(crate) struct Region<T> {
    addr: usize,
    len: usize,
    batch: u64,
    _t: PhantomData<T>,
}

impl Staging {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Staging {
        Staging { ctx, bufs: vec![], used: 0, want: 0, batch: 0, pending: false, queued: false }
    }

    /// The host address of the next `bytes` bytes.
    fn take(&mut self, bytes: usize) -> Result<usize> {
        let start = self.used.next_multiple_of(ALIGN);
        if let Some(b) = self.bufs.last().filter(|b| start + bytes <= b.len) {
            self.used = start + bytes;
            return Ok(b.addr + start);
        }
        let len = bytes.max(self.want).max(MIN_BUFFER).next_multiple_of(ALIGN);
        // Cacheable (not write-combined: the CPU reads results back from
        // it), portable to every context of the process.
        // SAFETY: the memory is only read after it was written: by the CPU
        // (upload) or by a transfer waited for in `sync` (fetch).
        let mut mem = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(dev_err("allocating pinned staging memory"))?;
        let addr = mem.as_mut_ptr().map_err(dev_err("allocating pinned staging memory"))? as usize;
        self.bufs.push(Buf { _mem: mem, addr, len });
        self.used = bytes;
        Ok(addr)
    }

    /// Copies `src` into the next region and queues its transfer to the
    /// device address `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` is device memory of this context with room for `src`, not
    /// used by anything else until `stream` has passed the transfer.
    pub(crate) unsafe fn upload<T: DeviceRepr>(&mut self, stream: &CudaStream, src: &[T], dst: u64) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        if bytes == 0 {
            return Ok(());
        }
        let addr = self.take(bytes)?;
        // SAFETY: `take` handed out `bytes` bytes at `addr` in a live pinned
        // buffer that no queued transfer touches (regions never overlap
        // within a batch); `src` is a distinct host array of `bytes` bytes.
        let region = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, bytes) };
        // SAFETY: any initialised T is readable as bytes (DeviceRepr types are plain data).
        let from = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, bytes) };
        copy(region, from);
        self.queued = true;
        // SAFETY: the region stays allocated and unchanged until `reset`,
        // which waits for the stream first; `dst` per the caller.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, addr as *const _, bytes, stream.cu_stream()) }
            .result()
            .map_err(dev_err("copying to the device"))
    }

    /// Queues the transfer of `len` elements from the device address `src`
    /// into the next region.
    ///
    /// # Safety
    /// `src` is device memory of this context holding `len` elements of
    /// `T` once `stream` reaches the transfer, alive until then.
    pub(crate) unsafe fn fetch<T: DeviceRepr>(
        &mut self,
        stream: &CudaStream,
        src: u64,
        len: usize,
    ) -> Result<Region<T>> {
        let bytes = len * std::mem::size_of::<T>();
        let addr = if bytes == 0 { ALIGN } else { self.take(bytes)? };
        if bytes > 0 {
            // SAFETY: the region is `bytes` bytes of a live pinned buffer,
            // written by nothing else and read only after `sync`.
            unsafe { sys::cuMemcpyDtoHAsync_v2(addr as *mut _, src, bytes, stream.cu_stream()) }
                .result()
                .map_err(dev_err("copying from the device"))?;
            self.pending = true;
            self.queued = true;
        }
        Ok(Region { addr, len, batch: self.batch, _t: PhantomData })
    }

    /// Waits for `stream`: every fetched region becomes readable.
    pub(crate) fn sync(&mut self, stream: &CudaStream) -> Result<()> {
        stream.synchronize().map_err(dev_err("synchronizing"))?;
        self.pending = false;
        self.queued = false;
        Ok(())
    }

    /// The elements of a fetched region.
    ///
    /// # Panics
    /// When the region's transfer was not waited for with [`Staging::sync`],
    /// or belongs to an earlier batch.
    pub(crate) fn read<T: DeviceRepr>(&self, r: &Region<T>) -> &[T] {
        assert!(!self.pending && r.batch == self.batch, "staging region read before its transfer was waited for");
        if r.len == 0 {
            return &[];
        }
        // SAFETY: the region lies in a buffer alive until `reset` (which
        // bumps `batch`, checked above); its transfer completed (`sync`);
        // it is aligned for T (ALIGN) and holds len elements written by the
        // device, which are valid T (DeviceRepr types are plain data).
        unsafe { std::slice::from_raw_parts(r.addr as *const T, r.len) }
    }

    /// Copies a fetched region into `dst` (several threads for large ones).
    pub(crate) fn read_into<T: DeviceRepr>(&self, r: &Region<T>, dst: &mut [T]) {
        let src = self.read(r);
        assert_eq!(src.len(), dst.len(), "staging region and destination differ in length");
        let bytes = std::mem::size_of_val(src);
        // SAFETY: both are arrays of the same length of a plain-data type.
        let (d, s) = unsafe {
            (
                std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, bytes),
                std::slice::from_raw_parts(src.as_ptr() as *const u8, bytes),
            )
        };
        copy(d, s);
    }

    /// Ends a batch: gives every region back, after waiting for `stream`
    /// if a transfer was queued since the last [`Staging::sync`].
    pub(crate) fn reset(&mut self, stream: &CudaStream) -> Result<()> {
        if self.queued {
            self.sync(stream)?;
        }
        let total: usize = self.bufs.iter().map(|b| b.len).sum();
        if self.bufs.len() > 1 || total > KEEP_BYTES {
            // Next time one buffer of the total, or none kept at all.
            self.bufs.clear();
            self.want = if total > KEEP_BYTES { 0 } else { total };
        }
        self.used = 0;
        self.batch += 1;
        Ok(())
    }
}

/// `dst.copy_from_slice(src)`, split over threads when large.
fn copy(dst: &mut [u8], src: &[u8]) {
    if src.len() < PARALLEL_COPY_BYTES {
        dst.copy_from_slice(src);
        return;
    }
    // Asked once: the answer comes from the scheduler affinity and cgroup
    // files, not something to read per batch.
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let threads =
        *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(COPY_THREADS));
    let chunk = src.len().div_ceil(threads).next_multiple_of(ALIGN);
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staging() -> (Staging, Arc<CudaStream>) {
        crate::cuda::probe().expect("a CUDA device");
        let ctx = CudaContext::new(0).expect("context");
        let stream = ctx.new_stream().expect("stream");
        (Staging::new(ctx), stream)
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn arrays_round_trip_and_a_grown_batch_leaves_one_buffer() {
        let (mut st, s) = staging();
        // Two batches: the first outgrows one buffer (3 regions of 0.75 MiB
        // and one of 6 MiB, beside a 1 MiB first buffer), the second fits
        // the single buffer the reset leaves.
        for batch in 0..2u64 {
            let a: Vec<u64> = (0..98_304).map(|i| i * 7 + batch).collect();
            let b: Vec<f32> = (0..1_572_864).map(|i| i as f32 * 0.5).collect();
            let c: Vec<u8> = (0..786_432u32).map(|i| (i % 251) as u8).collect();
            let (da, db, dc) = (
                s.alloc_zeros::<u64>(a.len()).unwrap(),
                s.alloc_zeros::<f32>(b.len()).unwrap(),
                s.alloc_zeros::<u8>(c.len()).unwrap(),
            );
            use crate::cuda::table::ptr;
            let (pa, pb, pc) = (ptr(&da, &s), ptr(&db, &s), ptr(&dc, &s));
            // SAFETY: each device buffer was sized for its array above.
            unsafe {
                st.upload(&s, &a, pa).unwrap();
                st.upload(&s, &b, pb).unwrap();
                st.upload(&s, &c, pc).unwrap();
            }
            // SAFETY: as above; the uploads precede the fetches on the stream.
            let (ra, rb, rc) = unsafe {
                (
                    st.fetch::<u64>(&s, pa, a.len()).unwrap(),
                    st.fetch::<f32>(&s, pb, b.len()).unwrap(),
                    st.fetch::<u8>(&s, pc, c.len()).unwrap(),
                )
            };
            st.sync(&s).unwrap();
            assert_eq!(st.read(&ra), &a[..]);
            let mut back = vec![0f32; b.len()];
            st.read_into(&rb, &mut back);
            assert_eq!(back, b);
            assert_eq!(st.read(&rc), &c[..]);
            let before = st.bufs.len();
            st.reset(&s).unwrap();
            if batch == 0 {
                assert!(before > 1, "the first batch needed more than one buffer");
            } else {
                assert_eq!(before, 1, "the second batch fit the buffer the first one left");
            }
        }
        assert_eq!(st.bufs.len(), 1);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    #[should_panic(expected = "before its transfer was waited for")]
    fn reading_a_region_before_sync_panics() {
        let (mut st, s) = staging();
        let d = s.alloc_zeros::<u64>(16).unwrap();
        // SAFETY: d holds 16 values.
        let r = unsafe { st.fetch::<u64>(&s, crate::cuda::table::ptr(&d, &s), 16) }.unwrap();
        st.read(&r);
    }
}
