//! Lanes: a stream with reusable device buffers and staging memory, one
//! batch at a time, and the transfers through it.

use super::*;

/// A stream with its reusable device buffers; one batch at a time.
pub(super) struct Lane {
    pub(super) stream: Arc<CudaStream>,
    pub(super) keys: Option<CudaSlice<u64>>,
    pub(super) values: Option<CudaSlice<f32>>,
    pub(super) scores: Option<CudaSlice<u64>>,
    pub(super) flags: Option<CudaSlice<u8>>,
    pub(super) flags2: Option<CudaSlice<u8>>,
    pub(super) counters: CudaSlice<u64>,
    /// Whether `counters` are zero once the stream's work so far is done
    /// (cleared behind a batch answered before it ran, off the next
    /// batch's path to its kernels): [`CudaTable::zero_counters`] then
    /// queues nothing.
    pub(super) counters_zero: bool,
    pub(super) lost_keys: Option<CudaSlice<u64>>,
    pub(super) lost_values: Option<CudaSlice<f32>>,
    pub(super) lost_scores: Option<CudaSlice<u64>>,
    pub(super) lost_kinds: Option<CudaSlice<u8>>,
    pub(super) counts: Option<CudaSlice<u32>>,
    pub(super) offsets: Option<CudaSlice<u64>>,
    /// find_at's output rows.
    pub(super) at: Option<CudaSlice<u32>>,
    /// A large find_or_insert's scratch: the probe's miss flags, or the
    /// parts of its deduplication ([`CudaTable::k_find_or_insert`]).
    pub(super) fior: Option<CudaSlice<u8>>,
    /// An apply_gradients' sums of repeated keys ([`CudaTable::k_sum`]).
    pub(super) sums: Option<CudaSlice<u8>>,
    /// Pinned memory the batch's host arrays pass through.
    pub(super) stage: Staging,
}

impl CudaTable {
    pub(super) fn lane(&self) -> Result<Lane> {
        if let Some(l) = self.lanes.lock().pop() {
            return Ok(l);
        }
        let stream = self.dev.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let counters = stream.alloc_zeros::<u64>(NCOUNTERS).map_err(dev_err("allocating counters"))?;
        Ok(Lane {
            stream,
            keys: None,
            values: None,
            scores: None,
            flags: None,
            flags2: None,
            counters,
            counters_zero: true,
            lost_keys: None,
            lost_values: None,
            lost_scores: None,
            lost_kinds: None,
            counts: None,
            offsets: None,
            at: None,
            fior: None,
            sums: None,
            stage: Staging::new(self.dev.ctx.clone()),
        })
    }

    /// Returns a lane to the pool once its batch is over (a lane whose
    /// stream fails is dropped).
    pub(super) fn put_lane(&self, mut l: Lane) {
        if l.stage.reset(&l.stream).is_ok() {
            self.lanes.lock().push(l);
        }
    }

    /// Counters zero for the work queued next on the lane's stream (which
    /// the caller then counts into).
    pub(super) fn zero_counters(&self, l: &mut Lane) -> Result<()> {
        if std::mem::replace(&mut l.counters_zero, false) {
            return Ok(());
        }
        l.stream.memset_zeros(&mut l.counters).map_err(dev_err("clearing counters"))
    }

    /// Queues the clearing of the lane's counters now, after the work
    /// that counted into them, so that the next batch on the lane finds
    /// them zero (a failure leaves that batch to clear them).
    pub(super) fn clear_counters_behind(&self, l: &mut Lane) {
        l.counters_zero = l.stream.memset_zeros(&mut l.counters).is_ok();
    }

    /// Waits for the lane and reads its counters (with whatever else was
    /// fetched into its staging memory before).
    pub(super) fn read_counters(&self, l: &mut Lane) -> Result<Counts> {
        // SAFETY: the counters buffer holds NCOUNTERS values and lives as long as the lane.
        let r = unsafe { l.stage.fetch(&l.stream, ptr(&l.counters, &l.stream), NCOUNTERS) }?;
        l.stage.sync(&l.stream)?;
        Ok(counts(l.stage.read(&r)))
    }

    /// Copies `src` into the lane buffer `buf` (grown as needed) through
    /// the lane's staging memory; returns a view of the copy.
    pub(super) fn upload<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        stage: &mut Staging,
        buf: &mut Option<CudaSlice<T>>,
        src: &[T],
    ) -> Result<DevPtr<T>> {
        let dst = Self::scratch(stream, buf, src.len())?;
        // SAFETY: `buf` holds at least src.len() elements and belongs to the
        // lane, whose stream orders this copy before the kernels reading it.
        unsafe { stage.upload(stream, src, dst.addr()) }?;
        Ok(dst)
    }

    /// The first `n` elements of the lane buffer `buf`, grown as needed.
    pub(super) fn scratch<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        buf: &mut Option<CudaSlice<T>>,
        n: usize,
    ) -> Result<DevPtr<T>> {
        ensure(stream, buf, n)?;
        Ok(DevPtr::of(buf.as_ref().expect("ensured"), stream).take(n))
    }

    /// Queues the transfer of the first `len` elements of the lane buffer
    /// `buf` into the lane's staging memory (read after `stage.sync`).
    pub(super) fn fetch<T: DeviceRepr>(
        stream: &Arc<CudaStream>,
        stage: &mut Staging,
        buf: &Option<CudaSlice<T>>,
        len: usize,
    ) -> Result<Region<T>> {
        let src = match buf {
            Some(b) if b.len() >= len => ptr(b, stream),
            _ if len == 0 => 0,
            _ => panic!("fetching {len} elements from a lane buffer sized for fewer"),
        };
        // SAFETY: `buf` holds at least len elements and belongs to the lane;
        // its stream orders this copy after the kernels writing it.
        unsafe { stage.fetch(stream, src, len) }
    }

    pub(super) fn with_lane<R>(&self, f: impl FnOnce(&mut Lane) -> Result<R>) -> Result<R> {
        let mut l = self.lane()?;
        let r = f(&mut l);
        if r.is_ok() {
            self.put_lane(l);
        }
        r
    }
}
