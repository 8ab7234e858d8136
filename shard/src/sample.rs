//! The shards' side of miss-ratio curves ([`crate::mrc`], issue 27): a
//! switch holding the sampling filter, and the bounded buffer the CPU
//! backend keeps sampled keys in until [`Shard::drain_samples`].
//!
//! The filter is [`Sampler::sampled`], applied to the keys of every lookup
//! and write a client names (not erase, export, load). While no sampler is
//! set, a batch costs one relaxed load of `Switch::on` and nothing per
//! key. While one is, the CPU backend hashes each key of the batch (one
//! mix, two multiplies) into a small local vector and takes the buffer's
//! mutex once per batch; on the CUDA backend the lookup and writer kernels
//! run the filter themselves as they read each key (`hkv_sample_warp` in
//! `kernels/table.cuh`) and append to a ring in device memory
//! (`cuda::table::sampling`).
//!
//! A drain hands over the keys in the order they were appended: batch
//! after batch, and within a batch in index order on the CPU backend; on
//! the CUDA backend a warp's keys at a time (each warp's in the order of
//! its lanes, the warps in the order the device ran them), as the batch's
//! own keys are processed in no set order. With them come the accesses
//! counted since the last drain; sampled
//! keys that found the buffer full ([`SAMPLE_BUFFER_KEYS`]) are lost and
//! counted as dropped. Keys sampled under an earlier sampler are filtered
//! again by [`crate::mrc::Mrc::observe_sampled`], so a sampler may change
//! between drains. A drain on the CUDA backend takes the table's inserter
//! lock group: a thread must not drain a table while it holds a device
//! batch of that table still pending (the GPU group's enqueued parts).
//!
//! [`Shard::drain_samples`]: crate::Shard::drain_samples

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use parking_lot::Mutex;

use crate::mrc::Sampler;
use crate::SampleDrain;

/// Sampled keys a shard holds between two drains (CPU buffer, CUDA ring):
/// 512 KiB. At a rate of 1 % that is the keys of 6.5 Mi accesses.
pub const SAMPLE_BUFFER_KEYS: usize = 64 * 1024;

/// The sampler in force: a relaxed flag read once per batch, and the
/// filter's two words behind a mutex, read only while the flag is set.
#[derive(Debug, Default)]
pub(crate) struct Switch {
    on: AtomicBool,
    sampler: Mutex<Option<Sampler>>,
}

impl Switch {
    /// The sampler in force, if any.
    #[inline]
    pub(crate) fn get(&self) -> Option<Sampler> {
        if !self.on.load(Relaxed) {
            return None;
        }
        *self.sampler.lock()
    }

    /// Sets or clears the sampler.
    pub(crate) fn set(&self, s: Option<Sampler>) {
        let mut g = self.sampler.lock();
        *g = s;
        self.on.store(s.is_some(), Relaxed);
    }
}

#[derive(Debug, Default)]
struct Buf {
    keys: Vec<u64>,
    accesses: u64,
    dropped: u64,
}

/// The CPU backend's sampled keys: the switch and a buffer of at most
/// [`SAMPLE_BUFFER_KEYS`] keys.
#[derive(Debug, Default)]
pub(crate) struct HostSamples {
    switch: Switch,
    buf: Mutex<Buf>,
}

impl HostSamples {
    pub(crate) fn set(&self, s: Option<Sampler>) {
        self.switch.set(s);
    }

    /// Filters the keys of one batch (in index order) into the buffer.
    #[inline]
    pub(crate) fn record(&self, keys: &[u64]) {
        if let Some(s) = self.switch.get() {
            self.record_with(s, keys);
        }
    }

    #[inline(never)]
    fn record_with(&self, s: Sampler, keys: &[u64]) {
        let mut local = Vec::new();
        for &k in keys {
            if s.sampled(k) {
                local.push(k);
            }
        }
        let mut b = self.buf.lock();
        b.accesses += keys.len() as u64;
        let take = (SAMPLE_BUFFER_KEYS - b.keys.len()).min(local.len());
        b.keys.extend_from_slice(&local[..take]);
        b.dropped += (local.len() - take) as u64;
    }

    /// Hands over what was sampled since the last drain.
    pub(crate) fn drain(&self, out: &mut Vec<u64>) -> SampleDrain {
        let mut b = self.buf.lock();
        out.extend_from_slice(&b.keys);
        let d = SampleDrain { accesses: b.accesses, sampled: b.keys.len() as u64, dropped: b.dropped };
        b.keys.clear();
        b.accesses = 0;
        b.dropped = 0;
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_buffer_counts_what_it_drops() {
        let h = HostSamples::default();
        let keys: Vec<u64> = (0..SAMPLE_BUFFER_KEYS as u64 + 10).collect();
        h.record(&keys);
        let mut out = vec![];
        assert_eq!(h.drain(&mut out), SampleDrain::default(), "off: nothing");
        h.set(Some(Sampler { seed: 1, threshold: u64::MAX }));
        h.record(&keys[..5]);
        h.record(&keys);
        let d = h.drain(&mut out);
        let all = SAMPLE_BUFFER_KEYS as u64 + 15;
        assert_eq!(d, SampleDrain { accesses: all, sampled: SAMPLE_BUFFER_KEYS as u64, dropped: 15 });
        assert_eq!(&out[..5], &keys[..5]);
        assert_eq!(&out[5..], &keys[..SAMPLE_BUFFER_KEYS - 5]);
        out.clear();
        assert_eq!(h.drain(&mut out), SampleDrain::default());
        assert!(out.is_empty());
    }
}
