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
//! own keys are processed in no set order. Each key comes with its tag
//! ([`crate::mrc::tag`]: the operation's kind, the batch's sequence
//! number and, for a find's or a contains' key, whether the table found
//! it), and with them the lookups counted since the last drain (writes
//! are sampled but are not accesses, issue 32). On the CPU backend a burst
//! that would overflow the buffer ([`SAMPLE_BUFFER_KEYS`]) lowers the
//! buffer's own threshold instead (nothing is dropped; the drain names the
//! threshold); on the CUDA backend sampled keys that find the ring full are
//! lost and counted as dropped, and the drain lowers the ring's own
//! threshold so that the next intervals fit. Keys sampled under an earlier sampler are filtered
//! again by [`crate::mrc::Mrc::observe_samples`], so a sampler may change
//! between drains. A drain on the CUDA backend takes the table's inserter
//! lock group: a thread must not drain a table while it holds a device
//! batch of that table still pending (the GPU group's enqueued parts).
//!
//! [`Shard::drain_samples`]: crate::Shard::drain_samples

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use parking_lot::Mutex;

use crate::mrc::{tag, with_outcome, Kind, Sampler, Samples};
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

#[derive(Debug)]
struct Buf {
    samples: Samples,
    /// Keys of lookups since the last drain, sampled or not.
    accesses: u64,
    dropped: u64,
    /// Batches recorded (their tags' sequence numbers).
    batches: u32,
    /// The buffer's own filter, below the sampler's once a burst would
    /// have overflowed it (see [`HostSamples::record`]); `u64::MAX`: none.
    threshold: u64,
}

impl Default for Buf {
    fn default() -> Self {
        Buf { samples: Samples::default(), accesses: 0, dropped: 0, batches: 0, threshold: u64::MAX }
    }
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

    /// Filters the keys of one batch of `kind` (in index order) into the buffer.
    #[inline]
    pub(crate) fn record(&self, keys: &[u64], kind: Kind) {
        if let Some(s) = self.switch.get() {
            self.record_with(s, keys, kind, None);
        }
    }

    /// Filters the keys of one lookup batch (find, contains; in index
    /// order) into the buffer, each tagged with the table's answer
    /// (`hit(i)`: key i was found), from which the estimator learns what
    /// the client does after a hit and after a miss ([`crate::mrc::outcome`]).
    #[inline]
    pub(crate) fn record_lookups(&self, keys: &[u64], hit: &dyn Fn(usize) -> bool) {
        if let Some(s) = self.switch.get() {
            self.record_with(s, keys, Kind::Lookup, Some(hit));
        }
    }

    /// Nothing is dropped (issue 32): when the batch's sampled keys would
    /// overflow the buffer, the buffer halves its own threshold and keeps,
    /// of what it holds and of the batch, only the keys below it, as often
    /// as needed. What it hands over is then a spatial sample at the lower
    /// rate of the whole stretch since the last drain, and the drain says
    /// so ([`SampleDrain::threshold`]): the estimator follows the rate down
    /// (it would have, with this many distinct keys) instead of seeing a
    /// gap.
    #[inline(never)]
    fn record_with(&self, s: Sampler, keys: &[u64], kind: Kind, hit: Option<&dyn Fn(usize) -> bool>) {
        // Room for the expected share and some: no regrowth on the way
        // (a fresh table samples every key until its estimator is full).
        let expect = (keys.len() as f64 * s.rate()) as usize;
        let room = (expect + expect / 8 + 16).min(keys.len());
        // The sampled keys, each with the table's answer where `hit` says it
        // (the batch's tag comes with the lock: its sequence number).
        let mut local = Samples { keys: Vec::with_capacity(room), tags: Vec::with_capacity(room) };
        for (i, &k) in keys.iter().enumerate() {
            if s.sampled(k) {
                local.keys.push(k);
                local.tags.push(hit.map_or(0, |h| with_outcome(0, h(i))));
            }
        }
        let mut b = self.buf.lock();
        if kind.is_lookup() {
            b.accesses += keys.len() as u64;
        }
        let t = tag(kind, b.batches);
        b.batches = b.batches.wrapping_add(1);
        local.tags.iter_mut().for_each(|x| *x |= t);
        if b.threshold < s.threshold {
            local.retain_below(s.seed, b.threshold);
        }
        while b.samples.len() + local.len() > SAMPLE_BUFFER_KEYS {
            let th = b.threshold.min(s.threshold) / 2;
            b.threshold = th;
            local.retain_below(s.seed, th);
            b.samples.retain_below(s.seed, th);
        }
        b.samples.push_tagged(&local.keys, &local.tags);
    }

    /// Hands over what was sampled since the last drain.
    pub(crate) fn drain(&self, out: &mut Samples) -> SampleDrain {
        let mut b = self.buf.lock();
        out.keys.extend_from_slice(&b.samples.keys);
        out.tags.extend_from_slice(&b.samples.tags);
        let d = SampleDrain {
            accesses: b.accesses,
            sampled: b.samples.len() as u64,
            dropped: b.dropped,
            threshold: (b.threshold != u64::MAX).then_some(b.threshold),
        };
        b.samples.clear();
        b.accesses = 0;
        b.dropped = 0;
        b.threshold = u64::MAX;
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mrc::sample_hash;

    /// Issue 32: a burst that would overflow the buffer lowers the
    /// buffer's threshold instead of losing keys: nothing is dropped, what
    /// is handed over is exactly the keys below the lower threshold, and
    /// the drain says which threshold that was.
    #[test]
    fn a_full_buffer_lowers_its_rate_and_drops_nothing() {
        let h = HostSamples::default();
        let keys: Vec<u64> = (0..SAMPLE_BUFFER_KEYS as u64 + 10).collect();
        h.record(&keys, Kind::Lookup);
        let mut out = Samples::default();
        assert_eq!(h.drain(&mut out), SampleDrain::default(), "off: nothing");
        let s = Sampler { seed: 1, threshold: u64::MAX };
        h.set(Some(s));
        h.record(&keys[..5], Kind::Lookup);
        h.record(&keys, Kind::Write);
        let d = h.drain(&mut out);
        let th = d.threshold.expect("the buffer lowered its threshold");
        assert_eq!(th, u64::MAX / 2, "halved once");
        let want: Vec<u64> = keys[..5].iter().chain(&keys).copied().filter(|&k| sample_hash(k, 1) < th).collect();
        assert_eq!(out.keys, want);
        assert_eq!(d, SampleDrain { accesses: 5, sampled: want.len() as u64, dropped: 0, threshold: Some(th) });
        let first = keys[..5].iter().filter(|&&k| sample_hash(k, 1) < th).count();
        assert!(out.tags[..first].iter().all(|&t| t == tag(Kind::Lookup, 0)));
        assert!(out.tags[first..].iter().all(|&t| t == tag(Kind::Write, 1)));
        out.clear();
        assert_eq!(h.drain(&mut out), SampleDrain::default());
        assert!(out.is_empty());
    }

    /// A lookup's sampled keys carry the table's answer in their tags, a
    /// write's none, and the batch part of the tag is the batch's alone.
    #[test]
    fn lookups_are_tagged_with_the_tables_answer() {
        use crate::mrc::{batch_of, outcome};
        let h = HostSamples::default();
        h.set(Some(Sampler { seed: 1, threshold: u64::MAX }));
        let keys: Vec<u64> = (1..=8).collect();
        h.record_lookups(&keys, &|i| i % 3 == 0);
        h.record(&keys[..2], Kind::Write);
        let mut out = Samples::default();
        let d = h.drain(&mut out);
        assert_eq!((d.accesses, d.sampled), (8, 10));
        let want: Vec<Option<bool>> = (0..8).map(|i| Some(i % 3 == 0)).chain([None, None]).collect();
        assert_eq!(out.tags.iter().map(|&t| outcome(t)).collect::<Vec<_>>(), want);
        assert!(out.tags[..8].iter().all(|&t| batch_of(t) == tag(Kind::Lookup, 0)));
        assert!(out.tags[8..].iter().all(|&t| t == tag(Kind::Write, 1)));
    }
}
