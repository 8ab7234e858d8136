//! Sampling for miss-ratio curves on the device ([`crate::sample`]): the
//! ring the lookup kernels (fused, `hkv_sample_warp` in `kernels/table.cuh`)
//! and the `sample_keys` kernel (`kernels/sample.cu`, for the writes)
//! append sampled keys to, the lookups' sampler argument, the writes'
//! launch, and the drain.
//!
//! The ring scheme: [`SAMPLE_BUFFER_KEYS`] key slots and two counters in
//! device memory, `counters[0]` the slots claimed since the last drain and
//! `counters[1]` the accesses (keys filtered) since then. A lookup kernel
//! ([`CudaTable::sample_args`], passed to `k_lookup` through
//! [`Ptrs::sample`]) filters each key as it reads it: each warp with a
//! sampled key claims its slots with one atomicAdd, and each block adds its
//! keys to the accesses with one more; no launch and no second read of the
//! keys. `sample_keys`, launched before a write's kernel, claims per run of
//! 1024 keys. Either writes a key only where its slot is below the
//! capacity; claims past it are the dropped keys. Launches of several lanes (reader or updater
//! batches run on several streams at once) share the ring through those
//! atomics. The drain takes the inserter lock group, so no batch of the
//! table runs then and every earlier one has been synchronised (each batch
//! waits for its streams before its group is released, [`Pending`] too):
//! every claimed slot below the capacity is written. It reads the counters,
//! copies slots `[0, min(claimed, capacity))`, and zeroes the counters, so
//! the next batch claims from slot 0 again: no tail, no wrap-around.
//! `sample_keys` is launched on the batch's own stream right after its keys
//! are there, before the operation's kernel, so it adds no synchronisation;
//! with no sampler set there is no launch and the lookups get a null ring
//! (one relaxed load per batch).
//!
//! The ring is allocated when a sampler is first set and kept while the
//! table lives (512 KiB and 16 bytes).

use std::sync::OnceLock;

use super::*;
use crate::mrc::Sampler;
use crate::sample::{Switch, SAMPLE_BUFFER_KEYS};
use crate::SampleDrain;

/// Keys per block of `sample_keys`, which also keep index order per claim.
const SAMPLE_BLOCK: u32 = 1024;

/// The sampled keys' ring in device memory. See the module docs.
pub(super) struct Ring {
    keys: CudaSlice<u64>,
    /// Slots claimed and accesses, since the last drain.
    counters: CudaSlice<u64>,
}

/// The sampler in force and the ring, once allocated.
#[derive(Default)]
pub(super) struct Sampling {
    switch: Switch,
    ring: OnceLock<Ring>,
}

impl CudaTable {
    /// [`Shard::set_sampler`]: allocates the ring on first use. A ring that
    /// cannot be allocated leaves sampling off (drains stay empty).
    pub(super) fn set_sampling(&self, sampler: Option<Sampler>) {
        if sampler.is_some() && self.sampling.ring.get().is_none() && self.alloc_ring().is_err() {
            self.sampling.switch.set(None);
            return;
        }
        self.sampling.switch.set(sampler);
    }

    fn alloc_ring(&self) -> Result<()> {
        let _g = self.lock.acquire(Group::Inserter);
        if self.sampling.ring.get().is_some() {
            return Ok(());
        }
        self.with_lane(|l| {
            let a = |e| dev_err("allocating the sample ring")(e);
            let keys = l.stream.alloc_zeros::<u64>(SAMPLE_BUFFER_KEYS).map_err(a)?;
            let counters = l.stream.alloc_zeros::<u64>(2).map_err(a)?;
            // Zeroed before any other stream's kernel can use them.
            l.stream.synchronize().map_err(dev_err("synchronizing"))?;
            let _ = self.sampling.ring.set(Ring { keys, counters });
            Ok(())
        })
    }

    /// The sampler for a lookup kernel that runs the filter fused
    /// (`hkv_sample_warp` in `kernels/table.cuh`), on stream `l`: off (all
    /// zeros) when no sampler is set or the ring is not allocated.
    pub(super) fn sample_args(&self, l: &CudaStream) -> SampleArgs {
        let (Some(s), Some(ring)) = (self.sampling.switch.get(), self.sampling.ring.get()) else {
            return SampleArgs::default();
        };
        SampleArgs {
            ring: ptr(&ring.keys, l),
            counters: ptr(&ring.counters, l),
            cap: ring.keys.len() as u64,
            seed: s.seed,
            threshold: s.threshold,
        }
    }

    /// Launches `sample_keys` over the `n` keys at `keys` (those with a
    /// non-zero flag in `only`, when given) on stream `l`, when a sampler
    /// is set; else does nothing. Batches of up to [`SEQUENTIAL_BATCH`]
    /// keys take one block, so their keys are appended in index order.
    ///
    /// # Safety
    /// `keys` holds `n` keys and `only` (when given) `n` flags on this
    /// table's device, alive until `l` is synchronised, which happens
    /// before the batch's lock group is released.
    pub(super) unsafe fn k_sample(
        &self,
        l: &CudaStream,
        n: usize,
        keys: Option<DevPtr<u64>>,
        only: Option<DevPtr<u8>>,
    ) -> Result<()> {
        let Some(s) = self.sampling.switch.get() else {
            return Ok(());
        };
        let Some(ring) = self.sampling.ring.get() else {
            return Ok(());
        };
        if n == 0 || keys.is_none() {
            return Ok(());
        }
        let k = arg("keys", keys, n)?;
        let o = arg("key filter", only, n)?;
        let n = n as u64;
        let cfg = crate::cuda::grid(if n <= SEQUENTIAL_BATCH as u64 { 1 } else { n }, SAMPLE_BLOCK)?;
        let (r, c, cap) = (ptr(&ring.keys, l), ptr(&ring.counters, l), ring.keys.len() as u64);
        let mut b = l.launch_builder(&self.f.sample);
        b.arg(&k).arg(&n).arg(&o).arg(&s.seed).arg(&s.threshold).arg(&r).arg(&cap).arg(&c);
        // SAFETY: sample_keys reads keys[0..n] and only[0..n] where
        // non-null (sized per the caller, checked above), writes ring slots
        // below cap (the ring's length) and atomically adds to the ring's
        // 2 counters; the ring lives as long as the table.
        unsafe { b.launch(cfg) }.map_err(dev_err("launching sample_keys"))?;
        Ok(())
    }

    /// [`Shard::drain_samples`]. A device error loses what the ring held
    /// (the table's next batch reports the error).
    pub(super) fn drain_ring(&self, out: &mut Vec<u64>) -> SampleDrain {
        let Some(ring) = self.sampling.ring.get() else {
            return SampleDrain::default();
        };
        // No batch runs, and every earlier one has finished (module docs).
        let _g = self.lock.acquire(Group::Inserter);
        self.with_lane(|l| {
            let s = l.stream.clone();
            let cap = ring.keys.len() as u64;
            // SAFETY: the counters hold 2 u64 and live as long as the table.
            let c = unsafe { l.stage.fetch::<u64>(&s, ptr(&ring.counters, &s), 2) }?;
            l.stage.sync(&s)?;
            let (claimed, accesses) = {
                let c = l.stage.read(&c);
                (c[0], c[1])
            };
            let m = claimed.min(cap);
            // SAFETY: the ring holds cap >= m keys and lives as long as the table.
            let keys = unsafe { l.stage.fetch::<u64>(&s, ptr(&ring.keys, &s), m as usize) }?;
            // SAFETY: the counters hold 2 u64; no other stream uses them
            // while the inserter group is held, and this stream orders the
            // copy after the fetches above.
            unsafe { l.stage.upload(&s, &[0u64; 2], ptr(&ring.counters, &s)) }?;
            l.stage.sync(&s)?;
            out.extend_from_slice(l.stage.read(&keys));
            Ok(SampleDrain { accesses, sampled: m, dropped: claimed - m })
        })
        .unwrap_or_default()
    }
}
