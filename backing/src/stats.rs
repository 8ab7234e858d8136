//! The tier's counters: what reads found, what writes sent, the queue's
//! window, errors per node, fetch latency and staleness histograms.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Power-of-two buckets of microseconds: bucket `i` holds samples in
/// `[2^(i-1), 2^i)` µs (bucket 0: under 1 µs), up to 2^39 µs (6 days).
const BUCKETS: usize = 40;

/// A lock-free latency histogram with power-of-two buckets: coarse (a
/// quantile is known to within a factor of two) and cheap enough to record
/// on every batch.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

impl Histogram {
    /// Records one sample.
    pub fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = (64 - us.leading_zeros() as usize).min(BUCKETS - 1);
        self.buckets[i].fetch_add(1, Relaxed);
    }

    /// The counts, bucket by bucket.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot { counts: self.buckets.iter().map(|b| b.load(Relaxed)).collect() }
    }
}

/// A histogram's counts: `counts[i]` samples under `2^i` µs (and at least
/// `2^(i-1)`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HistogramSnapshot {
    /// Samples per power-of-two bucket of microseconds.
    pub counts: Vec<u64>,
}

impl HistogramSnapshot {
    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The upper bound in µs of the bucket holding quantile `q` (0..=1);
    /// 0 without samples.
    pub fn quantile_us(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let want = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return 1u64 << i;
            }
        }
        1u64 << (self.counts.len().saturating_sub(1))
    }
}

/// The live counters of one table's tier.
#[derive(Debug, Default)]
pub struct Counters {
    pub(crate) keys_read: AtomicU64,
    pub(crate) found: AtomicU64,
    pub(crate) found_queued: AtomicU64,
    pub(crate) absent: AtomicU64,
    pub(crate) late: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) rows_written: AtomicU64,
    pub(crate) write_batches: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) queued_total: AtomicU64,
    pub(crate) queue_full: AtomicU64,
    pub(crate) invalidations: AtomicU64,
    pub(crate) fetch: Histogram,
    pub(crate) write: Histogram,
    pub(crate) staleness: Histogram,
    pub(crate) node_errors: Mutex<BTreeMap<String, u64>>,
}

impl Counters {
    pub(crate) fn node_error(&self, node: &str) {
        *self.node_errors.lock().entry(node.to_string()).or_default() += 1;
    }

    pub(crate) fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(n as u64, Relaxed);
    }
}

/// A table tier's stats at one moment (the daemon's stats document carries
/// it per table as `backing`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// `read-only`, `write-through` or `write-back`.
    pub mode: String,
    /// Hash-tagged groups the rows are spread over.
    pub groups: u32,
    /// Keys asked of the tier (cache misses).
    pub keys_read: u64,
    /// Of those, found in the cluster or in the write-back queue.
    pub found: u64,
    /// Of the found, served from the write-back queue.
    pub found_queued: u64,
    /// Absent from the cluster.
    pub absent: u64,
    /// Not fetched before the deadline.
    pub late: u64,
    /// Not fetched because their node failed.
    pub unavailable: u64,
    /// Rows written to the cluster.
    pub rows_written: u64,
    /// Write batches sent.
    pub write_batches: u64,
    /// Row bytes read from the cluster.
    pub bytes_in: u64,
    /// Row bytes written to the cluster.
    pub bytes_out: u64,
    /// Rows now in the write-back queue (queued or being sent).
    pub queue_rows: u64,
    /// Their bytes.
    pub queue_bytes: u64,
    /// The queue's bound in bytes (the write-back window).
    pub queue_limit_bytes: u64,
    /// Age of the oldest queued row, ms.
    pub queue_oldest_ms: u64,
    /// Rows ever queued.
    pub queued_total: u64,
    /// Writers refused with `resource_exhausted`.
    pub queue_full: u64,
    /// Keys named by other writers' stream entries that this host heard
    /// (each an invalidation, whether or not the key is cached here).
    pub invalidations: u64,
    /// Stream entries of this host's acknowledged writes waiting to be
    /// appended (the stream's node refused them or did not answer); a
    /// reset entry counts one.
    #[serde(default)]
    pub unpublished_entries: u64,
    /// Their bytes (keys, and 48 per entry).
    #[serde(default)]
    pub unpublished_bytes: u64,
    /// Their bound: past it they are replaced by one reset entry.
    #[serde(default)]
    pub unpublished_limit_bytes: u64,
    /// Times the bound was reached (each made a reset entry, which has
    /// every other host drop its cache of the table).
    #[serde(default)]
    pub unpublished_resets: u64,
    /// Errors per node (`host:port`).
    pub node_errors: BTreeMap<String, u64>,
    /// Fetch latency per batch.
    pub fetch_us: HistogramSnapshot,
    /// Write latency per batch (to the cluster's acknowledgement).
    pub write_us: HistogramSnapshot,
    /// Time from a write's acknowledgement on its host to its invalidation
    /// here (clocks of two hosts: as good as their synchronisation).
    pub staleness_us: HistogramSnapshot,
}
