//! The Adaptive policy's device state (issue 36): the frequency sketch,
//! 128 ghosts and a state word per bucket, all sized for the table's
//! largest size as the CPU backend's (`crate::cpu::adapt`, whose rules the
//! kernels follow: `kernels/table.cuh`, "adaptive policy"), so that growth
//! leaves them where they are. The counted accesses and the halving of the
//! sketch are kept here, on the host.

use super::*;
use crate::cpu::adapt::{sketch_lines, Meta, PERIOD_PER_SLOT};

/// The Adaptive policy's buffers and the raw addresses the kernels take.
pub(super) struct DeviceAdapt {
    _sketch: CudaSlice<u8>,
    _ghosts: CudaSlice<u32>,
    _meta: CudaSlice<u64>,
    sketch: u64,
    ghosts: u64,
    meta: u64,
    lines: u64,
    /// Accesses counted in the sketch since it was last halved.
    counted: AtomicU64,
}

const _: () = {
    assert!(crate::cpu::adapt::INITIAL_WINDOW == hkv_kernels::abi::HKV_ADAPT_INITIAL_WINDOW as u64);
    assert!(crate::cpu::adapt::STEP == hkv_kernels::abi::HKV_ADAPT_STEP as u64);
};

impl DeviceAdapt {
    /// Zeroed sketch and ghosts, each bucket's state word at its initial
    /// share, for a table of at most `max_buckets` buckets.
    pub(super) fn new(stream: &Arc<CudaStream>, max_buckets: u64) -> Result<DeviceAdapt> {
        let lines = sketch_lines(max_buckets * S);
        let al = |what: &'static str| dev_err(what);
        let sketch = stream.alloc_zeros::<u8>((lines * 64) as usize).map_err(al("allocating the sketch"))?;
        let ghosts = stream.alloc_zeros::<u32>((max_buckets * S) as usize).map_err(al("allocating ghosts"))?;
        let meta = stream
            .clone_htod(&vec![Meta::INITIAL.0; max_buckets as usize])
            .map_err(al("initialising the buckets' window shares"))?;
        stream.synchronize().map_err(al("initialising the adaptive policy's state"))?;
        Ok(DeviceAdapt {
            sketch: ptr(&sketch, stream),
            ghosts: ptr(&ghosts, stream),
            meta: ptr(&meta, stream),
            _sketch: sketch,
            _ghosts: ghosts,
            _meta: meta,
            lines,
            counted: AtomicU64::new(0),
        })
    }

    /// `sc` with this state's addresses.
    pub(super) fn args(&self, sc: ScoringArgs) -> ScoringArgs {
        ScoringArgs { sketch: self.sketch, ghosts: self.ghosts, meta: self.meta, sketch_lines: self.lines, ..sc }
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
