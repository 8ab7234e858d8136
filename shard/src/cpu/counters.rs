//! Operation counters of a shard, shared by the CPU and CUDA backends.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::{Op, ShardStats, Summary};

/// Operation counters of a shard (shared by the backends).
#[derive(Default)]
pub(crate) struct Counters {
    ops: [AtomicU64; Op::ALL.len()],
    keys: [AtomicU64; Op::ALL.len()],
    hits: AtomicU64,
    misses: AtomicU64,
    inserts: AtomicU64,
    pub(crate) evictions: AtomicU64,
    rejections: AtomicU64,
}

impl Counters {
    pub(crate) fn op(&self, op: Op, n: usize) {
        let i = Op::ALL.iter().position(|&o| o == op).expect("op listed");
        self.ops[i].fetch_add(1, Relaxed);
        self.keys[i].fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn summary(&self, s: &Summary) {
        self.inserts.fetch_add(s.inserted, Relaxed);
        self.evictions.fetch_add(s.evicted, Relaxed);
        self.rejections.fetch_add(s.rejected, Relaxed);
    }

    /// The shard's statistics from these counters and the given state.
    pub(crate) fn stats(
        &self,
        size: u64,
        capacity: u64,
        fast_tier_bytes: u64,
        host_tier_bytes: u64,
        lock: crate::LockState,
    ) -> ShardStats {
        ShardStats {
            size,
            capacity,
            load_factor: size as f64 / capacity.max(1) as f64,
            ops: self.ops.iter().map(|a| a.load(Relaxed)).collect(),
            keys: self.keys.iter().map(|a| a.load(Relaxed)).collect(),
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            inserts: self.inserts.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
            rejections: self.rejections.load(Relaxed),
            fast_tier_bytes,
            host_tier_bytes,
            lock,
        }
    }

    pub(crate) fn lookups(&self, hits: u64, n: usize) {
        self.hits.fetch_add(hits, Relaxed);
        self.misses.fetch_add(n as u64 - hits, Relaxed);
    }
}
