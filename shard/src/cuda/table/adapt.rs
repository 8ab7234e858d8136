//! The Adaptive policy's state for the CUDA backend (issue 36): the
//! frequency sketch on the device, sized for the table's largest size as
//! the CPU backend's (`crate::cpu::adapt`, whose rules the kernels follow:
//! `kernels/table.cuh`, "adaptive policy"), so that growth leaves it where
//! it is; on the host, the counted accesses and the halving of the sketch,
//! and the window share's miniatures (`crate::cpu::adapt::Window`, the CPU
//! backend's own type), fed each batch's keys from the host after the
//! batch. The kernels take the share as a launch argument.

use super::*;
use crate::cpu::adapt::{sketch_lines, Window, ADMIT_MARGIN, PERIOD_PER_SLOT, PROTECTED_TENTHS};

/// The Adaptive policy's buffers, the raw address the kernels take, and
/// the window share.
pub(super) struct DeviceAdapt {
    _sketch: CudaSlice<u8>,
    sketch: u64,
    lines: u64,
    /// Accesses counted in the sketch since it was last halved.
    counted: AtomicU64,
    /// The window share and its miniatures.
    pub(super) window: Window,
}

const _: () = {
    assert!(PROTECTED_TENTHS as u64 == hkv_kernels::abi::HKV_ADAPT_PROTECTED_TENTHS as u64);
    assert!(ADMIT_MARGIN as u64 == hkv_kernels::abi::HKV_ADAPT_ADMIT_MARGIN as u64);
};

impl DeviceAdapt {
    /// A zeroed sketch for a table of at most `max_buckets` buckets, and
    /// the window share of a table now of `slots` slots.
    pub(super) fn new(stream: &Arc<CudaStream>, max_buckets: u64, slots: u64) -> Result<DeviceAdapt> {
        let lines = sketch_lines(max_buckets * S);
        let al = |what: &'static str| dev_err(what);
        let sketch = stream.alloc_zeros::<u8>((lines * 64) as usize).map_err(al("allocating the sketch"))?;
        stream.synchronize().map_err(al("initialising the adaptive policy's state"))?;
        Ok(DeviceAdapt {
            sketch: ptr(&sketch, stream),
            _sketch: sketch,
            lines,
            counted: AtomicU64::new(0),
            window: Window::new(slots),
        })
    }

    /// `sc` with this state's address and the next batch's window share.
    pub(super) fn args(&self, sc: ScoringArgs) -> ScoringArgs {
        ScoringArgs { sketch: self.sketch, sketch_lines: self.lines, window: self.window.bucket_slots(), ..sc }
    }
}

impl CudaTable {
    /// Adaptive, a writer batch with policy scores: counts its `n` keys
    /// (those `only` lets through, when given) in the sketch before its
    /// rounds run (`adapt_count`), as the CPU backend counts a batch's
    /// keys before placing any. `counted`: how many that is (for the
    /// halving period). No-op for other policies.
    ///
    /// # Safety
    /// `keys` holds `n` keys and `only`, when given, `n` flags, alive until
    /// `l` is synchronised.
    pub(super) unsafe fn k_adapt_count(
        &self,
        l: &CudaStream,
        keys: DevPtr<u64>,
        n: u64,
        only: Option<DevPtr<u8>>,
        counted: u64,
    ) -> Result<()> {
        let Some(a) = &self.adapt else { return Ok(()) };
        if n == 0 {
            return Ok(());
        }
        let sc = self.scoring(false);
        let k = arg("keys", Some(keys), n as usize)?;
        let o = arg("key filter", only, n as usize)?;
        let mut b = l.launch_builder(&self.f.adapt_count);
        b.arg(&sc).arg(&k).arg(&n).arg(&o);
        // SAFETY: adapt_count reads keys[0..n] and only[0..n] (where
        // non-null), both that long (checked by `arg`), and increments
        // counters of the sketch, whose lines sc.sketch_lines describes.
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching adapt_count"))?;
        a.counted.fetch_add(counted, Relaxed);
        Ok(())
    }

    /// Adaptive, after a batch of a table of `st`'s size: its accesses
    /// (the keys the sketch counted, in index order) to the window share's
    /// miniatures. No-op for other policies.
    /// `key(i)`: key `i` of the batch's `n` if it counts.
    pub(super) fn adapt_observe(&self, st: &Storage, n: usize, key: impl Fn(usize) -> Option<u64> + Sync) {
        if let Some(a) = &self.adapt {
            a.window.observe(st.nbuckets * S, n, key);
        }
    }

    /// Adaptive, a device batch (its keys in device memory): waits for
    /// stream `l` to run the batch, copies its `n` keys (and `only`, and
    /// for a find the `found` flags) to the host and feeds the accesses the
    /// sketch counted to the miniatures ([`CudaTable::adapt_observe`]): a
    /// device batch of an adaptive table waits for its kernels before it
    /// returns (the share of the next batch depends on this one's keys).
    /// No-op for other policies.
    ///
    /// # Safety
    /// `keys` holds `n` keys, `only` and `found`, when given, `n` flags of
    /// device memory of this table's context, alive until this returns.
    pub(super) unsafe fn adapt_observe_device(
        &self,
        l: &CudaStream,
        st: &Storage,
        keys: DevPtr<u64>,
        n: usize,
        only: Option<DevPtr<u8>>,
        found: Option<DevPtr<u8>>,
    ) -> Result<()> {
        if self.adapt.is_none() || n == 0 {
            return Ok(());
        }
        // The batch's kernels first; then plain (synchronous) copies, so
        // that no copy into these vectors is in flight when one fails.
        l.synchronize().map_err(dev_err("synchronizing"))?;
        let copy = |src: u64, dst: *mut std::ffi::c_void, bytes: usize| -> Result<()> {
            // SAFETY: `src` holds `bytes` bytes of live device memory (the
            // caller's contract, lengths checked by `arg`), written by
            // kernels `l` has finished; `dst` is a host buffer of `bytes`
            // bytes; the copy is done when the call returns.
            unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(dst, src, bytes) }
                .result()
                .map_err(dev_err("copying a device batch's keys or flags to the host"))
        };
        let mut k = vec![0u64; n];
        copy(arg("keys", Some(keys), n)?, k.as_mut_ptr().cast(), n * 8)?;
        let flags = |p: Option<DevPtr<u8>>, what: &str| -> Result<Option<Vec<u8>>> {
            let Some(p) = p else { return Ok(None) };
            let mut v = vec![0u8; n];
            copy(arg(what, Some(p), n)?, v.as_mut_ptr().cast(), n)?;
            Ok(Some(v))
        };
        let o = flags(only, "key filter")?;
        let f = flags(found, "found flags")?;
        let pass = |i: usize| o.as_ref().is_none_or(|o| o[i] != 0) && f.as_ref().is_none_or(|f| f[i] != 0);
        self.adapt_observe(st, n, |i| pass(i).then_some(k[i]));
        Ok(())
    }

    /// Adaptive: `hits` accesses counted by a refreshing find's kernel.
    pub(super) fn adapt_counted(&self, hits: u64) {
        if let Some(a) = &self.adapt {
            a.counted.fetch_add(hits, Relaxed);
        }
    }

    /// Adaptive, at a writer batch's end (its group still held): halves
    /// every sketch counter once the accesses counted reach 10 × the
    /// table's slots (`adapt_halve`; the CPU backend's `Adapt::age`).
    pub(super) fn k_adapt_age(&self, l: &CudaStream, st: &Storage) -> Result<()> {
        let Some(a) = &self.adapt else { return Ok(()) };
        if a.counted.load(Relaxed) < st.nbuckets * S * PERIOD_PER_SLOT {
            return Ok(());
        }
        a.counted.store(0, Relaxed);
        let sc = self.scoring(false);
        let mut b = l.launch_builder(&self.f.adapt_halve);
        b.arg(&sc);
        // SAFETY: adapt_halve rewrites the sketch's lines * 16 words, the
        // buffer's whole length.
        unsafe { b.launch(blocks(a.lines * 16)?) }.map_err(dev_err("launching adapt_halve"))?;
        Ok(())
    }
}
