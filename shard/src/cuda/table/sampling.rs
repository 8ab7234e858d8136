//! Sampling for miss-ratio curves on the device ([`crate::sample`]): the
//! ring the lookup and writer kernels append sampled keys to (they run the
//! filter themselves, `hkv_sample_warp` in `kernels/table.cuh`), the
//! sampler argument they take, and the drain.
//!
//! The ring scheme: [`SAMPLE_BUFFER_KEYS`] key slots and two counters in
//! device memory, `counters[0]` the slots claimed since the last drain and
//! `counters[1]` the accesses (keys filtered) since then. The kernel of a
//! sampled batch ([`CudaTable::sample_args`], passed to `k_lookup`,
//! `k_upsert` and `k_update` through [`Ptrs::sample`]) filters each key it
//! serves as it reads it: each warp with a sampled key claims its slots
//! with one atomicAdd and writes a key only where its slot is below the
//! capacity (claims past it are the dropped keys), and each block adds its
//! keys to the accesses with one more atomicAdd; no launch of its own, no
//! second read of the keys, and no synchronisation. A batch launched in
//! rounds (`in_rounds`) samples each key in the one round that serves it.
//! Launches of several lanes (reader or updater batches run on several
//! streams at once) share the ring through those atomics. The drain takes
//! the inserter lock group, so no batch of the table runs then and every
//! earlier one has been synchronised (each batch waits for its streams
//! before its group is released, [`Pending`] too): every claimed slot below
//! the capacity is written. It reads the counters, copies slots
//! `[0, min(claimed, capacity))`, and zeroes the counters, so the next batch
//! claims from slot 0 again: no tail, no wrap-around. With no sampler set
//! the kernels get a null ring and test it once (one relaxed load per
//! batch on the host).
//!
//! Beside each key slot a tag byte ([`crate::mrc::tag`]: the batch's
//! operation kind and sequence number, `HkvSample::tag`) is written to a
//! second ring of the same length, so that the estimator tells lookups
//! from writes and one batch from the next (issue 32); only lookups
//! (kinds 0 and 1) add to the accesses counter. A kernel cannot lower the
//! rate mid-batch as the CPU buffer does: sampled keys past the ring's
//! capacity are dropped and counted (`counters[0] - cap`, shown with the
//! curve), and the drain that finds them lowers the ring's own threshold
//! so that the next intervals fit (the estimator follows it down).
//!
//! The ring is allocated when a sampler is first set and kept while the
//! table lives (576 KiB and 16 bytes).

use std::sync::OnceLock;

use super::*;
use crate::mrc::{tag, Sampler, Samples};
use crate::sample::{Switch, SAMPLE_BUFFER_KEYS};
use crate::SampleDrain;

/// The sampled keys' ring in device memory. See the module docs.
pub(super) struct Ring {
    keys: CudaSlice<u64>,
    /// One tag byte per key slot ([`crate::mrc::tag`]).
    tags: CudaSlice<u8>,
    /// Slots claimed and accesses, since the last drain.
    counters: CudaSlice<u64>,
}

/// The sampler in force and the ring, once allocated.
pub(super) struct Sampling {
    switch: Switch,
    ring: OnceLock<Ring>,
    /// Sampled batches launched: the tags' sequence numbers.
    batches: AtomicU32,
    /// The ring's own threshold, below the sampler's once a drain found
    /// the ring overflowed (`u64::MAX`: none yet; see [`CudaTable::drain_ring`]).
    own: std::sync::atomic::AtomicU64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            switch: Switch::default(),
            ring: OnceLock::new(),
            batches: AtomicU32::new(0),
            own: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }
}

impl CudaTable {
    /// [`Shard::set_sampler`]: allocates the ring on first use. A ring that
    /// cannot be allocated leaves sampling off (drains stay empty).
    /// Setting a sampler drops the ring's own lowered threshold (the
    /// estimator sets the rate it followed down to, at most that).
    pub(super) fn set_sampling(&self, sampler: Option<Sampler>) {
        self.sampling.own.store(u64::MAX, Relaxed);
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
            let tags = l.stream.alloc_zeros::<u8>(SAMPLE_BUFFER_KEYS).map_err(a)?;
            let counters = l.stream.alloc_zeros::<u64>(2).map_err(a)?;
            // Zeroed before any other stream's kernel can use them.
            l.stream.synchronize().map_err(dev_err("synchronizing"))?;
            let _ = self.sampling.ring.set(Ring { keys, tags, counters });
            Ok(())
        })
    }

    /// The sampler for a lookup kernel that runs the filter fused
    /// (`hkv_sample_warp` in `kernels/table.cuh`), on stream `l`: off (all
    /// zeros) when no sampler is set or the ring is not allocated. `kind`:
    /// the batch's operation, written as a tag beside each sampled key.
    pub(super) fn sample_args(&self, l: &CudaStream, kind: Kind) -> SampleArgs {
        let (Some(s), Some(ring)) = (self.sampling.switch.get(), self.sampling.ring.get()) else {
            return SampleArgs::default();
        };
        SampleArgs {
            ring: ptr(&ring.keys, l),
            counters: ptr(&ring.counters, l),
            cap: ring.keys.len() as u64,
            seed: s.seed,
            threshold: s.threshold.min(self.sampling.own.load(Relaxed)),
            tags: ptr(&ring.tags, l),
            tag: tag(kind, self.sampling.batches.fetch_add(1, Relaxed)) as u64,
        }
    }

    /// [`Shard::drain_samples`]. A device error loses what the ring held
    /// (the table's next batch reports the error).
    pub(super) fn drain_ring(&self, out: &mut Samples) -> SampleDrain {
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
            // SAFETY: the tag ring holds cap >= m bytes and lives as long as the table.
            let tags = unsafe { l.stage.fetch::<u8>(&s, ptr(&ring.tags, &s), m as usize) }?;
            // SAFETY: the counters hold 2 u64; no other stream uses them
            // while the inserter group is held, and this stream orders the
            // copy after the fetches above.
            unsafe { l.stage.upload(&s, &[0u64; 2], ptr(&ring.counters, &s)) }?;
            l.stage.sync(&s)?;
            out.keys.extend_from_slice(l.stage.read(&keys));
            out.tags.extend_from_slice(l.stage.read(&tags));
            // The ring overflowed: the next batches sample at a rate that
            // would have fit this interval's claims in half the ring, and
            // the estimator follows it down (it filters these keys at the
            // new threshold and lowers its sampler to it). At 1.2 G keys/s
            // the 64 Ki slots held under 2 % of one interval's claims at
            // the first rate; from the next interval on they fit.
            let own = &self.sampling.own;
            if claimed > cap {
                let now = self.sampling.switch.get().map_or(u64::MAX, |s| s.threshold).min(own.load(Relaxed));
                let lower = (u128::from(now) * u128::from(cap) / u128::from(claimed) / 2) as u64;
                own.store(lower.max(1), Relaxed);
            }
            let t = own.load(Relaxed);
            Ok(SampleDrain { accesses, sampled: m, dropped: claimed - m, threshold: (t != u64::MAX).then_some(t) })
        })
        .unwrap_or_default()
    }
}
