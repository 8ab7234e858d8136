//! The CPU backend: the table in host memory, batches spread over all cores.
//!
//! Every field of a bucket is a relaxed atomic, so readers need no per-bucket
//! lock: the table-wide [`GroupLock`] already keeps writers out while they
//! run. Writers (updaters and inserters, whose batches are processed in
//! parallel) serialise per bucket on a small mutex. Values live in one array
//! addressed by position, `(bucket * 128 + slot) * dim`. The whole storage
//! sits behind an `RwLock` that only growth takes for writing (under the
//! inserter group, so no batch is running then).
//!
//! Lookups are software-pipelined in groups of 16 keys (`PIPE`): while the
//! lookups of group g run, the candidate keys and value rows of group g + 1
//! and the digest lines of group g + 2 are being fetched, with prefetch
//! instructions issued back to back, so that cache misses overlap instead of
//! queueing one behind the other. The prefetch instruction (`prefetch`) is
//! this backend's one `unsafe` call, outside the CUDA modules where `unsafe`
//! otherwise lives; the rest of the backend denies `unsafe_code`.
//! Bucket indices use a precomputed reciprocal ([`Buckets`](crate::hash::Buckets))
//! instead of a 64-bit division.
//!
//! # Layout
//! - `adapt`: the Adaptive policy's rules, sketch and window share.
//! - `minisim`: the miniature caches that choose Adaptive's window share
//!   (std and `crate::hash` only: `shard/bench/adapt_model.rs` includes
//!   it, with a `hash` module of its own).
//! - `bucket`: one bucket (digests, keys, scores, occupancy, writer mutex)
//!   and its SWAR digest scan.
//! - `storage`: the buckets and the value array of one table size.
//! - `batch`: a batch split over the cores (output arrays, accumulators).
//! - `pipeline`: the lookup pipeline of find and contains.
//! - `prefetch`: the prefetch hint, the one `unsafe` item.
//! - `write`: one key's write path (placement, eviction, admission).
//! - `growth`: doubling the buckets.
//! - `ops`: the batch operations, [`Shard`] for [`CpuTable`].
//! - `counters`: operation counters, shared with the CUDA backend.
//! - this file: [`CpuTable`], its construction and key location.

#![deny(unsafe_code)]

pub(crate) mod adapt;
mod batch;
mod bucket;
mod counters;
mod growth;
// Some of its methods serve only `shard/bench/adapt_model.rs`.
#[allow(dead_code)]
pub(crate) mod minisim;
mod ops;
mod pipeline;
pub(crate) mod prefetch;
mod storage;
mod write;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::config::{BucketMode, TableConfig};
use crate::error::Result;
use crate::lock::{Group, GroupLock};
use crate::sample::HostSamples;
use crate::score::{Clock, Scorer};
use crate::{Shard, BUCKET_SLOTS};

pub(crate) use counters::Counters;
use storage::Storage;
pub use storage::BUCKET_BYTES;

const S: usize = BUCKET_SLOTS;
/// f32 per 64-byte cache line.
const LINE_FLOATS: usize = 16;
/// Keys per parallel task once a batch is split.
const GRAIN: usize = 2048;
/// Keys whose memory accesses are overlapped by the lookup pipeline.
const PIPE: usize = 16;

/// Whether this process's CPU tables split a batch of more than
/// [`SEQUENTIAL_BATCH`](crate::SEQUENTIAL_BATCH) keys over the rayon pool
/// (the default), or run every batch in index order on the calling
/// thread. For a process that already runs as many shards side by side as
/// there are cores (the daemon's CPU backend by default), splitting
/// only adds work for the pool, whose idle workers then spin in
/// `sched_yield`: about a sixth of the daemon's CPU in a warm run and
/// 8 % in a cold one on two cores (`backing/BENCHMARKS.md`).
pub fn set_parallel_batches(on: bool) {
    batch::set_parallel(on);
}

/// The table in host memory. See the crate docs for the semantics.
pub struct CpuTable {
    config: TableConfig,
    storage: RwLock<Storage>,
    lock: GroupLock,
    size: AtomicU64,
    epoch: AtomicU32,
    clock: Arc<dyn Clock>,
    counters: Counters,
    /// Keys sampled for miss-ratio curves ([`Shard::set_sampler`]).
    samples: HostSamples,
    /// The Adaptive policy's side state; `None` for every other policy.
    adapt: Option<adapt::Adapt>,
    /// What a reserve allocated in advance ([`Shard::prepare_reserve`]).
    prepared: parking_lot::Mutex<Option<growth::Prepared>>,
}

impl std::fmt::Debug for CpuTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuTable")
            .field("config", &self.config)
            .field("capacity", &self.capacity())
            .field("size", &self.size())
            .finish()
    }
}

impl CpuTable {
    /// A table on the process's clock (`score::process_clock`).
    pub fn new(config: TableConfig) -> Result<CpuTable> {
        Self::with_clock(config, crate::score::process_clock())
    }

    /// A table reading Lru / EpochLru time from `clock`.
    pub fn with_clock(config: TableConfig, clock: Arc<dyn Clock>) -> Result<CpuTable> {
        config.validate()?;
        let storage = Storage::new(config.buckets(), config.dim)?;
        let adapt = (config.policy == crate::ScorePolicy::Adaptive)
            .then(|| adapt::Adapt::new(config.max_buckets(), storage.nbuckets() * S as u64));
        Ok(CpuTable {
            config,
            storage: RwLock::new(storage),
            prepared: parking_lot::Mutex::new(None),
            lock: GroupLock::new(),
            size: AtomicU64::new(0),
            epoch: AtomicU32::new(0),
            clock,
            counters: Counters::default(),
            samples: HostSamples::default(),
            adapt,
        })
    }

    /// The current lock-group state.
    pub fn lock_state(&self) -> crate::LockState {
        self.lock.state()
    }

    fn dual(&self) -> bool {
        self.config.mode == BucketMode::Dual
    }

    fn scorer(&self) -> Scorer {
        Scorer {
            policy: self.config.policy,
            now_ns: self.clock.now_ns(),
            epoch: self.epoch.load(Relaxed),
            lfu_ties: self.config.lfu_ties,
        }
    }

    /// The candidate buckets of a key: `(b1, b2)`, `b2 == b1` in single mode.
    #[inline]
    fn buckets_of(&self, st: &Storage, key: u64) -> (usize, usize, u8) {
        let (b1, d) = st.div.locate(key);
        let b2 = if self.dual() { st.div.bucket2(key, b1) } else { b1 };
        (b1 as usize, b2 as usize, d)
    }

    /// Where a present key sits, without locks (reader group, or under the
    /// candidate buckets' mutexes).
    #[inline]
    fn locate_entry(&self, st: &Storage, key: u64) -> Option<(usize, usize)> {
        let (b1, b2, d) = self.buckets_of(st, key);
        if let Some(s) = st.buckets[b1].find(key, d) {
            return Some((b1, s));
        }
        if b2 != b1 {
            return st.buckets[b2].find(key, d).map(|s| (b2, s));
        }
        None
    }
}

/// One occupied slot: `(bucket, slot, key, digest, score)`.
pub type RawSlot = (u64, usize, u64, u8, u64);

/// Test support: the raw bucket contents, for invariant checks.
impl CpuTable {
    /// Every occupied slot, and the bucket count. Takes the reader group.
    pub fn dump_slots(&self) -> (u64, Vec<RawSlot>) {
        let _g = self.lock.acquire(Group::Reader);
        let st = self.storage.read();
        let mut out = Vec::new();
        for (b, bk) in st.buckets.iter().enumerate() {
            bk.each(|s| out.push((b as u64, s, bk.key(s), bk.digest(s), bk.score(s))));
        }
        (st.nbuckets(), out)
    }
}
