//! # hkv-shard: the HierarchicalKV table
//!
//! A table is a cache: a full bucket is its normal state, and every insert
//! into a full bucket is settled in place, by evicting the bucket's
//! minimum-score entry or by refusing the newcomer when its score is lower
//! (admission control). This crate holds the table's semantics, its CPU
//! backend (the reference every other backend is checked against) and the
//! `hkv-sim` and `hkv-bench` binaries.
//!
//! ## Storage
//! Slots come in buckets of [`BUCKET_SLOTS`] = 128. Per bucket: `digests[128]`
//! (one byte per slot, exactly one 128-byte cache line), `keys[128]` and
//! `scores[128]` (u64). Values (`f32 × dim`) are addressed by position —
//! bucket and slot — never by pointer. A lookup compares the 128 digests of
//! its bucket 8 bytes at a time (SWAR) and reads a key only where the digest
//! matches, so a miss costs one digest line plus ~0.5 key reads. A free
//! slot's digest is [`hash::EMPTY_DIGEST`], which no key has, so the GPU
//! kernels find the lowest free slot from the digest line alone.
//!
//! ## Placement and eviction
//! Single mode: a key lives only in bucket `h1 % buckets` ([`hash`]). A new
//! key takes the lowest free slot; in a full bucket it replaces the
//! minimum-score slot (lowest slot on ties) unless its score is lower, in
//! which case it is rejected (paper Algorithm 2). Dual mode (Algorithm 3): a
//! key has two buckets; while either has room it goes to the less loaded
//! (the first on ties); when both are full it competes in the one whose
//! minimum score is lower (the first on ties). Every operation works in both
//! modes.
//!
//! Lfu ties: with [`LfuTies::Lru`] (the default) an Lfu score is the
//! frequency in its high 24 bits and the batch's clock in ~ms in its low 40
//! ([`score`]), so the minimum-score victim is the least frequent entry and,
//! among equal frequencies, the least recently written; scores returned by
//! find and export are these packed values ([`score::lfu_frequency`] reads
//! the count). [`LfuTies::LowestSlot`] keeps the reference library's plain
//! counts and lowest-slot victim.
//!
//! ## Concurrency
//! A [`lock::GroupLock`] admits readers (find, contains, export) together,
//! updaters (assign, assign_scores, accumulate into existing keys) together,
//! and inserters (anything that may allocate, evict or erase) alone. Inside a
//! batch, keys are processed in parallel across cores under per-bucket
//! locks. Batches of up to [`SEQUENTIAL_BATCH`] keys are processed in index
//! order, so their per-key outcomes are deterministic (on the CPU backend,
//! every batch is after [`cpu::set_parallel_batches`]`(false)`).
//!
//! ## Deliberate differences from the reference library
//! - Lfu scores saturate at `u64::MAX` instead of wrapping.
//! - Lfu evicts the least recently written of equal frequencies, its scores
//!   packing frequency (saturating at 2^24 − 1) and clock
//!   ([`LfuTies::Lru`], the default): the reference's lowest slot let every
//!   newcomer to a full bucket evict the previous one (issue 27).
//!   [`LfuTies::LowestSlot`] restores the reference's rule and scores.
//! - Lfu and EpochLfu default the increment to 1 when no scores are passed.
//! - `accum_or_assign` takes no per-key flags: existing keys accumulate,
//!   missing keys are inserted.
//! - A batch holding a reserved key is refused whole with an error (the
//!   reference skips such keys silently).
//! - Erase frees the slot outright (no tombstone: every slot of the bucket is
//!   always searched, so no probe chain needs one).
//! - Duplicate keys within one batch are allowed: they are applied one after
//!   the other (in index order for batches up to [`SEQUENTIAL_BATCH`] keys, in
//!   an unspecified order above), and the table never holds a key twice.
//!
//! # Layout
//! - [`check`] holds the argument checks every backend runs (and the daemon,
//!   on a batch it splits over shards), and [`check::CheckedKeys`], a
//!   batch scanned whole for reserved markers before it is split.
//! - [`config`] holds [`TableConfig`], [`ScorePolicy`], [`LfuTies`], [`BucketMode`].
//! - [`hash`] computes bucket, digest and shard hashes.
//! - [`score`] has the score rules per policy and the clocks.
//! - [`lock`] is the triple-group lock and its observable state.
//! - [`cpu`] is the CPU backend, [`cpu::CpuTable`]: buckets, storage, batch
//!   splitting, the lookup pipeline, the write path, growth, counters and
//!   the batch operations, one module each (`bucket`, `storage`, `batch`,
//!   `pipeline`, `write`, `growth`, `counters`, `ops`); its one `unsafe`
//!   item is the prefetch hint, alone in `cpu/prefetch.rs`.
//! - [`cuda`] holds every `unsafe` but the CPU prefetch: it finds CUDA
//!   devices, compiles the kernels of `hkv-kernels` (with an on-disk cache),
//!   hashes features on the GPU (`hasher`), and holds page-locked memory:
//!   `host_frame` ([`cuda::HostFrame`], a frame the GPU writes rows into,
//!   and [`cuda::PinnedRows`], its rows as a find's typed destination),
//!   `staging` (each lane's pinned host arrays), `ptr` (`DevPtr<T>`, a
//!   device address with its element type and length), `device`.
//!   - [`cuda::table`] (also [`cuda_table`]) is the CUDA backend,
//!     [`cuda_table::CudaTable`]: `abi`, `kernels`, `launch`, `storage`,
//!     `lane`, `growth`, `host_batch`, `device_batch`, `ops`.
//!   - [`cuda::group`] (also [`multi`]) is one table over several GPUs,
//!     [`multi::GpuGroup`]: `plan`, `node`, `nccl`, `device_route`,
//!     `peer_route`, `host_route`, `reshard`.
//! - [`mrc`] estimates miss-ratio curves (SHARDS sampling, LRU stack
//!   distances): the hit rate of a smaller or larger table.
//! - [`sample`] is the shards' side of it: the sampler switch and the
//!   bounded buffer of sampled keys ([`Shard::set_sampler`],
//!   [`Shard::drain_samples`]).
//! - [`pin`] (`cuda/pin.rs`) page-locks a client's registered memfd mapping
//!   (`cuMemHostRegister`) and hands its rows to a find as [`Rows::Pinned`].
//! - [`features`] turns raw features into keys (TensorFlow-compatible).
//! - [`error`] holds [`Error`].
//! - this file: the [`Shard`] trait every backend implements, [`Rows`] (a
//!   find's destination: any memory, or a page-locked frame's rows), result
//!   types, [`open`].
//! - binaries (`src/bin/`): `hkv-sim` (cache quality, miss-ratio curves),
//!   `hkv-bench`, `hkv-hash-bench`, `hkv-multi-bench`.
//! - tests: `model` (against a reference model), `cpu` and `cuda` (one
//!   conformance suite, `tests/common/`), `concurrency`, `features`,
//!   `multi`, `mrc` (curves against exact simulation), `sim`.

#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod check;
pub mod cli;
pub mod config;
// The CPU prefetch (one intrinsic) is the one `unsafe` outside `cuda`.
#[allow(unsafe_code)]
pub mod cpu;
// Every other `unsafe` of the crate: driver calls, kernel launches, pinned memory.
#[allow(unsafe_code)]
pub mod cuda;
pub use cuda::pin;
pub mod error;
pub mod features;
pub mod hash;
pub mod lock;
pub mod mrc;
pub mod optim;
pub mod sample;
pub mod score;

/// The GPU group, at its former path ([`cuda::group`]).
pub use cuda::group as multi;
/// The CUDA table, at its former path ([`cuda::table`]).
pub use cuda::table as cuda_table;

use serde::{Deserialize, Serialize};

pub use config::{BucketMode, CudaTuning, FindOrInsert, Footprint, LfuTies, ScorePolicy, TableConfig};
pub use error::{Error, Result};
pub use lock::{Group, LockState};

/// Slots per bucket: 128 one-byte digests fill exactly one 128-byte cache line.
pub const BUCKET_SLOTS: usize = 128;
/// Marks a free slot.
pub const EMPTY_KEY: u64 = u64::MAX;
/// Smallest reserved key: `u64::MAX - 3 ..= u64::MAX` are refused as input.
pub const RESERVED_KEY_MIN: u64 = u64::MAX - 3;
/// Batches up to this many keys are processed sequentially in index order.
pub const SEQUENTIAL_BATCH: usize = 4096;

/// Whether `key` is one of the reserved marker values.
#[inline(always)]
pub fn is_reserved(key: u64) -> bool {
    key >= RESERVED_KEY_MIN
}

/// What an operation did with one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[repr(u8)]
pub enum Outcome {
    /// The key was present and was written (or, for find_or_insert, read).
    Updated = 0,
    /// The key was absent and took a free slot.
    Inserted = 1,
    /// The key was absent and took the slot of the bucket's minimum-score entry.
    Evicted = 2,
    /// The key was absent and its score was below the bucket minimum: refused.
    Rejected = 3,
    /// The key was absent and the operation only updates existing keys.
    #[default]
    Absent = 4,
}

impl Outcome {
    /// Decodes the wire byte.
    pub fn from_u8(b: u8) -> Option<Outcome> {
        Some(match b {
            0 => Outcome::Updated,
            1 => Outcome::Inserted,
            2 => Outcome::Evicted,
            3 => Outcome::Rejected,
            4 => Outcome::Absent,
            _ => return None,
        })
    }
}

/// Per-outcome counts of one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Keys that were present.
    pub updated: u64,
    /// Keys placed in a free slot.
    pub inserted: u64,
    /// Keys placed by evicting another entry.
    pub evicted: u64,
    /// Keys refused by admission control.
    pub rejected: u64,
    /// Keys absent for an update-only operation.
    pub absent: u64,
}

impl Summary {
    /// Counts one outcome.
    #[inline]
    pub fn add(&mut self, o: Outcome) {
        match o {
            Outcome::Updated => self.updated += 1,
            Outcome::Inserted => self.inserted += 1,
            Outcome::Evicted => self.evicted += 1,
            Outcome::Rejected => self.rejected += 1,
            Outcome::Absent => self.absent += 1,
        }
    }

    /// Sums two summaries.
    pub fn merge(mut self, o: Summary) -> Summary {
        self.updated += o.updated;
        self.inserted += o.inserted;
        self.evicted += o.evicted;
        self.rejected += o.rejected;
        self.absent += o.absent;
        self
    }
}

/// Why an entry appears in `insert_and_evict`'s output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum Lost {
    /// A resident entry that lost its slot to a newcomer.
    Evicted = 0,
    /// An input entry refused by admission control (with its input value and score).
    Rejected = 1,
}

/// Entries that left (or never entered) the table in `insert_and_evict`,
/// compacted. Order is unspecified.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Evictions {
    /// Keys.
    pub keys: Vec<u64>,
    /// Values, `dim` floats per key.
    pub values: Vec<f32>,
    /// Scores (for rejected inputs: the score they would have had).
    pub scores: Vec<u64>,
    /// Why each entry is here.
    pub kinds: Vec<Lost>,
}

impl Evictions {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.keys.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
    fn append(&mut self, mut o: Evictions) {
        self.keys.append(&mut o.keys);
        self.values.append(&mut o.values);
        self.scores.append(&mut o.scores);
        self.kinds.append(&mut o.kinds);
    }
}

/// A predicate on key and score: `(key & key_mask) == key_pattern` and
/// `min_score <= score <= max_score`. The default matches everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Filter {
    /// Bits of the key to compare.
    pub key_mask: u64,
    /// Required value of those bits.
    pub key_pattern: u64,
    /// Smallest score that matches.
    pub min_score: u64,
    /// Largest score that matches.
    pub max_score: u64,
}

impl Default for Filter {
    fn default() -> Self {
        Filter { key_mask: 0, key_pattern: 0, min_score: 0, max_score: u64::MAX }
    }
}

impl Filter {
    /// Matches every entry.
    pub const ALL: Filter = Filter { key_mask: 0, key_pattern: 0, min_score: 0, max_score: u64::MAX };

    /// Entries whose score is at least `min`.
    pub fn score_at_least(min: u64) -> Filter {
        Filter { min_score: min, ..Filter::ALL }
    }

    /// Entries whose score is below `threshold`.
    pub fn score_below(threshold: u64) -> Filter {
        Filter { max_score: threshold.saturating_sub(1), min_score: 0, ..Filter::ALL }
    }

    /// Whether an entry matches.
    #[inline]
    pub fn matches(&self, key: u64, score: u64) -> bool {
        (key & self.key_mask) == self.key_pattern && score >= self.min_score && score <= self.max_score
    }
}

/// Entries copied out by `export_batch(_if)`, compacted, in slot order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Export {
    /// Keys.
    pub keys: Vec<u64>,
    /// Values, `dim` floats per key.
    pub values: Vec<f32>,
    /// Scores.
    pub scores: Vec<u64>,
}

/// Counters of one shard since creation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShardStats {
    /// Entries stored.
    pub size: u64,
    /// Slots.
    pub capacity: u64,
    /// size / capacity.
    pub load_factor: f64,
    /// Batches per operation, indexed like [`Op::ALL`].
    pub ops: Vec<u64>,
    /// Keys per operation, indexed like [`Op::ALL`].
    pub keys: Vec<u64>,
    /// Lookups (find, contains, find_or_insert) that found their key.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Keys placed in a free slot.
    pub inserts: u64,
    /// Keys placed by evicting another entry.
    pub evictions: u64,
    /// Keys refused by admission control.
    pub rejections: u64,
    /// Value bytes in the fast (device) tier.
    pub fast_tier_bytes: u64,
    /// Value bytes in the host tier.
    pub host_tier_bytes: u64,
    /// Lock-group state.
    pub lock: LockState,
}

/// The operations, for statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum Op {
    Find,
    Contains,
    InsertOrAssign,
    InsertAndEvict,
    FindOrInsert,
    Assign,
    AssignScores,
    AccumOrAssign,
    Erase,
    EraseIf,
    Clear,
    Export,
    Reserve,
    Load,
    ApplyGradients,
}

impl Op {
    /// Every op, in stats order.
    pub const ALL: [Op; 15] = [
        Op::Find,
        Op::Contains,
        Op::InsertOrAssign,
        Op::InsertAndEvict,
        Op::FindOrInsert,
        Op::Assign,
        Op::AssignScores,
        Op::AccumOrAssign,
        Op::Erase,
        Op::EraseIf,
        Op::Clear,
        Op::Export,
        Op::Reserve,
        Op::Load,
        Op::ApplyGradients,
    ];

    /// The snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            Op::Find => "find",
            Op::Contains => "contains",
            Op::InsertOrAssign => "insert_or_assign",
            Op::InsertAndEvict => "insert_and_evict",
            Op::FindOrInsert => "find_or_insert",
            Op::Assign => "assign",
            Op::AssignScores => "assign_scores",
            Op::AccumOrAssign => "accum_or_assign",
            Op::Erase => "erase",
            Op::EraseIf => "erase_if",
            Op::Clear => "clear",
            Op::Export => "export",
            Op::Reserve => "reserve",
            Op::Load => "load",
            Op::ApplyGradients => "apply_gradients",
        }
    }

    /// The lock group the op runs in.
    pub fn group(self) -> Group {
        match self {
            Op::Find | Op::Contains | Op::Export => Group::Reader,
            Op::Assign | Op::AssignScores | Op::ApplyGradients => Group::Updater,
            _ => Group::Inserter,
        }
    }
}

/// One table's slice on one device: the operations every backend implements.
///
/// All operations are batched. Output arrays are the caller's and must have
/// the batch's length (times `dim` for values). On error nothing is changed.
pub trait Shard: Send + Sync {
    /// The configuration the shard was created with.
    fn config(&self) -> &TableConfig;
    /// f32 elements per value.
    fn dim(&self) -> usize {
        self.config().dim
    }
    /// Slots (buckets × 128); grows with `reserve` or automatic growth.
    fn capacity(&self) -> u64;
    /// Entries stored.
    fn size(&self) -> u64;
    /// size / capacity.
    fn load_factor(&self) -> f64 {
        self.size() as f64 / self.capacity() as f64
    }
    /// Sets the epoch used by EpochLru and EpochLfu scores.
    fn set_global_epoch(&self, epoch: u32);
    /// The adaptive policy's window share for the next batch (slots of
    /// each bucket's 128); None for other policies. For benchmarks and
    /// diagnostics.
    fn adaptive_window(&self) -> Option<u32> {
        None
    }

    /// Copies the values (and scores) of present keys; misses leave the
    /// caller's values untouched. Returns the number of hits. Reader group.
    fn find(&self, keys: &[u64], values: &mut [f32], found: &mut [bool], scores: Option<&mut [u64]>) -> Result<usize>;
    /// find without scores into `rows`, which may be page-locked memory
    /// ([`Rows::Pinned`]) that the CUDA backend copies the rows into
    /// straight from the device; the CPU backend treats both alike. The
    /// same answer as [`Shard::find`].
    fn find_into(&self, keys: &[u64], rows: Rows<'_>, found: &mut [bool]) -> Result<usize> {
        self.find(keys, rows.into_values(), found, None)
    }
    /// find into rows of a larger answer: key `i`'s values go to row
    /// `at[i]` of `rows` (`dim` floats a row) and `found[at[i]]` becomes 1;
    /// a miss writes a row of zeros and `found[at[i]] = 0`, so every target
    /// row is written (the answer's buffer may hold an earlier answer);
    /// other rows are left as they are. `at` must be strictly increasing and
    /// below `found.len()`, and `rows` must hold `found.len()` rows. For
    /// answers that several shards fill in turn (the daemon's response
    /// frame); into [`Rows::Pinned`] the CUDA backend's kernel writes the
    /// rows itself. Returns the number of hits.
    fn find_at(&self, keys: &[u64], at: &[u32], rows: Rows<'_>, found: &mut [u8]) -> Result<usize> {
        find_at_by_find(self, keys, at, rows.into_values(), found)
    }
    /// Presence only. Returns the number present. Reader group.
    fn contains(&self, keys: &[u64], found: &mut [bool]) -> Result<usize>;
    /// Upsert: present keys get the value and the policy's score; absent keys
    /// are inserted, evicting or rejected. Inserter group.
    fn insert_or_assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary>;
    /// insert_or_assign that also returns every entry that lost its slot and
    /// every refused input. Inserter group.
    fn insert_and_evict(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Evictions>;
    /// Present keys: stored value copied into `values[i]`, score refreshed.
    /// Absent keys: `values[i]` inserted. Inserter group.
    fn find_or_insert(
        &self,
        keys: &[u64],
        values: &mut [f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary>;
    /// Overwrites values of present keys (score per policy); absent keys are
    /// ignored. Updater group.
    fn assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary>;
    /// Writes scores of present keys per policy. Updater group.
    fn assign_scores(&self, keys: &[u64], scores: Option<&[u64]>, outcomes: Option<&mut [Outcome]>) -> Result<Summary>;
    /// Present keys: value += delta (updater group). Absent keys: the delta is
    /// inserted as the value (inserter group, only if any key is absent).
    fn accum_or_assign(
        &self,
        keys: &[u64],
        deltas: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary>;
    /// One optimizer step in the table ([`optim`]): for each present key,
    /// `step` applied to its stored row (values and optimizer state,
    /// `step.row_dim()` floats: the table's dim) with its gradient row
    /// (`step.dim` floats of `grads`); absent keys are left absent. `found`
    /// gets a flag per key; `updated`, when given, the key's values
    /// (`step.dim` floats) as its step left them (zeros for an absent key).
    /// Duplicate keys are stepped one after the other, or, with
    /// `step.sum`, their gradients summed first ([`optim::sum_duplicates`])
    /// and each key stepped once (then `updated` must be `None`; each
    /// occurrence gets its key's flag). Returns the count of keys absent
    /// (of distinct keys, with `step.sum`). Scores as `assign` gives them (the policy's update rule
    /// without caller scores).
    ///
    /// The default reads the rows with [`Shard::find`], steps them on the
    /// host and writes them back with [`Shard::assign`]: correct for a
    /// batch alone, but a write to the same keys between the two is
    /// overwritten (a backend serves it in place to be atomic per row, as
    /// the CPU backend does).
    fn apply_gradients(
        &self,
        keys: &[u64],
        grads: &[f32],
        step: &optim::Step,
        found: &mut [bool],
        updated: Option<&mut [f32]>,
    ) -> Result<u64> {
        apply_gradients_by_find(self, keys, grads, step, found, updated)
    }
    /// Removes keys; returns how many were present. Inserter group.
    fn erase(&self, keys: &[u64], erased: Option<&mut [bool]>) -> Result<usize>;
    /// Removes every entry matching the filter; returns the count. Inserter group.
    fn erase_if(&self, filter: &Filter) -> Result<u64>;
    /// Removes everything; capacity is kept. Inserter group.
    fn clear(&self) -> Result<()>;
    /// Entries in slots `[offset, offset + n)`, compacted. Reader group.
    fn export_batch(&self, offset: u64, n: u64) -> Result<Export> {
        self.export_batch_if(offset, n, &Filter::ALL)
    }
    /// export_batch restricted to entries matching the filter. Reader group.
    fn export_batch_if(&self, offset: u64, n: u64, filter: &Filter) -> Result<Export>;
    /// Grows (by doubling buckets) to at least `capacity` slots. Inserter group.
    /// A shard grows wholly or not at all, and after a successful
    /// [`Shard::prepare_reserve`] of the same capacity (the table not grown
    /// since) it allocates nothing large: on the CPU backend nothing, and
    /// it cannot fail; on the CUDA backend a lane's per-key outcome bytes.
    fn reserve(&self, capacity: u64) -> Result<()>;
    /// Allocates (and keeps) what `reserve(capacity)` will need, without
    /// changing the table, so that a table of several shards grows all of
    /// them or none: the daemon prepares every shard, then reserves, or
    /// cancels all when one could not prepare. Backends that cannot
    /// allocate in advance do nothing here.
    fn prepare_reserve(&self, capacity: u64) -> Result<()> {
        let _ = capacity;
        Ok(())
    }
    /// Frees what [`Shard::prepare_reserve`] kept.
    fn cancel_reserve(&self) {}
    /// Touches every page of the table's memory, without changing it,
    /// until done or `stop` is set: a table built for a restore then pays
    /// for the kernel's zeroing of fresh pages while its loads still wait
    /// for the disk, not in the loads. No lock group; never blocks writes.
    /// Backends whose memory comes touched do nothing.
    fn prefault(&self, stop: &std::sync::atomic::AtomicBool) {
        let _ = stop;
    }
    /// Inserts entries with their scores verbatim, whatever the policy
    /// (restore from a checkpoint). Inserter group.
    fn load(&self, keys: &[u64], values: &[f32], scores: &[u64]) -> Result<Summary>;
    /// Counters and lock state.
    fn stats(&self) -> ShardStats;
    /// The lowest score a write made from now on can get, for policies whose
    /// scores grow with time (Lru: the clock; EpochLru: epoch and clock;
    /// EpochLfu: the epoch); 0 for Lfu and Custom. Incremental checkpoints
    /// export entries at or above the value read when the previous one began.
    fn clock_score(&self) -> u64;
    /// After a restore whose highest score was `max_score`: moves the epoch
    /// and the clock so that later writes rank above the restored entries
    /// (see `score::resume_after`).
    fn resume_after(&self, max_score: u64);

    /// Sets (or, with `None`, stops) the miss-ratio sampling filter
    /// ([`mrc::Sampler`]): from the next batch on, the keys of every lookup
    /// and write (find, find_at, contains, insert_or_assign,
    /// insert_and_evict, find_or_insert, assign, assign_scores,
    /// accum_or_assign and their device-batch forms; not erase, export or
    /// load) that pass it are kept for [`Shard::drain_samples`] with their
    /// operation's [`mrc::Kind`], and the keys of lookups counted as
    /// accesses. Off by default; while off, a batch costs
    /// one relaxed load more. The default does nothing (a backend that does
    /// not sample).
    fn set_sampler(&self, sampler: Option<mrc::Sampler>) {
        let _ = sampler;
    }

    /// Appends the keys sampled since the last drain to `out`, each with
    /// its tag ([`mrc::tag`]: the operation's [`mrc::Kind`] and the
    /// batch's sequence number), batch after
    /// batch in the order the shard ran them; within a batch, index order
    /// on the CPU backend, and no set order on the CUDA backend (the kernel
    /// appends a warp's keys at a time, in the order the device runs the
    /// warps, see [`sample`]): compare a batch's keys as a multiset. It
    /// says how many keys were
    /// looked up meanwhile, how many sampled keys were lost to a full
    /// buffer ([`sample::SAMPLE_BUFFER_KEYS`]) and the buffer's own lower
    /// threshold if it set one. Feed them to
    /// [`mrc::Mrc::observe_samples`]. The default drains nothing.
    fn drain_samples(&self, out: &mut mrc::Samples) -> SampleDrain {
        let _ = out;
        SampleDrain::default()
    }

    /// An operation on a client's device memory in place
    /// ([`cuda::table::CudaTable::run_ipc`]): only a backend whose table
    /// lies in device memory serves it; the default refuses it.
    fn run_ipc(
        &self,
        op: cuda::table::DeviceOp,
        arrays: &cuda::table::IpcArrays,
        part: Option<cuda::table::IpcPart>,
        order: cuda::table::IpcOrder<'_>,
    ) -> Result<cuda::table::Counts> {
        let _ = (arrays, part, order);
        Err(Error::Device(format!("{op:?} on a client's device memory needs a table on the CUDA backend")))
    }

    /// Refuses a batch in a client's device memory that holds a reserved
    /// key ([`cuda::table::CudaTable::check_ipc_keys`]); the default
    /// refuses every such batch, as [`Shard::run_ipc`] does.
    fn check_ipc_keys(&self, keys: &cuda::ipc::IpcSpan<u64>) -> Result<()> {
        let _ = keys;
        Err(Error::Device("keys in a client's device memory need a table on the CUDA backend".into()))
    }
}

/// A find's answer written in place: the flags (one byte per row of the
/// answer, 1 for a hit) and the rows of `keys`, at rows `at` of the answer
/// when several shards fill it in turn ([`Shard::find_at`]), else at rows
/// `0..keys.len()` ([`Shard::find_into`]). Every target row is written:
/// a miss gets zeros (the answer's memory may hold an earlier answer).
/// Returns the number of hits.
pub fn find_answer(
    s: &dyn Shard,
    keys: &[u64],
    at: Option<&[u32]>,
    mut rows: Rows<'_>,
    flags: &mut [u8],
) -> Result<usize> {
    if let Some(at) = at {
        return s.find_at(keys, at, rows, flags);
    }
    check::len("found flags", flags.len(), keys.len(), || format!("{} keys", keys.len()))?;
    let mut hit = vec![false; keys.len()];
    let hits = s.find_into(keys, rows.reborrow(), &mut hit)?;
    let dim = s.dim().max(1);
    for ((b, &h), row) in flags.iter_mut().zip(&hit).zip(rows.into_values().chunks_exact_mut(dim)) {
        *b = u8::from(h);
        if !h {
            row.fill(0.0);
        }
    }
    Ok(hits)
}

/// What one [`Shard::drain_samples`] handed over.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleDrain {
    /// Keys of lookups (find, find_at, contains, find_or_insert: the
    /// references the table's hit rate counts) since the last drain,
    /// sampled or not (counted only while a sampler is set). Writes are
    /// sampled but not counted here (issue 32).
    pub accesses: u64,
    /// Keys appended to the output.
    pub sampled: u64,
    /// Sampled keys lost because the buffer was full (the CUDA ring at
    /// GPU rates; the CPU buffer lowers its threshold instead).
    pub dropped: u64,
    /// The filter the keys handed over passed when the shard lowered it
    /// below the sampler's to keep its buffer from overflowing (the CPU
    /// backend); feed it to [`mrc::Mrc::observe_samples`].
    pub threshold: Option<u64>,
}

/// Which backend a shard runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// CUDA when a driver and a device are present, else CPU.
    #[default]
    Auto,
    /// Host memory, all cores.
    Cpu,
    /// One CUDA device.
    Cuda,
}

/// Where a find writes its rows: ordinary memory, or page-locked memory
/// mapped for the GPU ([`cuda::PinnedRows`], which only a
/// [`cuda::HostFrame`] gives out), so that whether the CUDA backend may
/// write there directly is known from the type, not asked of the driver.
pub enum Rows<'a> {
    /// Any memory.
    Host(&'a mut [f32]),
    /// A page-locked frame's rows.
    Pinned(cuda::PinnedRows<'a>),
}

impl<'a> Rows<'a> {
    /// The same rows for a shorter borrow (to pass to one find and keep).
    pub fn reborrow(&mut self) -> Rows<'_> {
        match self {
            Rows::Host(v) => Rows::Host(v),
            Rows::Pinned(p) => Rows::Pinned(p.reborrow()),
        }
    }

    /// The rows as a slice (what the CPU backend writes into).
    pub fn into_values(self) -> &'a mut [f32] {
        match self {
            Rows::Host(v) => v,
            Rows::Pinned(p) => p.into_values(),
        }
    }
}

impl<'a> From<&'a mut [f32]> for Rows<'a> {
    fn from(v: &'a mut [f32]) -> Rows<'a> {
        Rows::Host(v)
    }
}

/// [`Shard::find_at`] through [`Shard::find`]: the rows found into a
/// batch-sized array, then each placed at its target row.
/// [`Shard::apply_gradients`] through the trait's own find and assign
/// (its default).
pub fn apply_gradients_by_find<S: Shard + ?Sized>(
    s: &S,
    keys: &[u64],
    grads: &[f32],
    step: &optim::Step,
    found: &mut [bool],
    updated: Option<&mut [f32]>,
) -> Result<u64> {
    let (n, d, w) = (keys.len(), step.dim, s.dim());
    optim::check_apply(w, step, keys, grads, found, updated.as_deref())?;
    if let Some(r) = optim::apply_summed(keys, grads, step, found, |k, g, st, f| s.apply_gradients(k, g, st, f, None)) {
        return r;
    }
    let mut rows = vec![0.0f32; n * w];
    s.find(keys, &mut rows, found, None)?;
    // Duplicates step the row their first occurrence holds, in index order.
    let mut first: std::collections::HashMap<u64, usize> = std::collections::HashMap::with_capacity(n);
    let mut own: Vec<usize> = Vec::with_capacity(n);
    for (i, &k) in keys.iter().enumerate() {
        own.push(*first.entry(k).or_insert(i));
    }
    let missing = found.iter().filter(|&&f| !f).count() as u64;
    if own.iter().enumerate().all(|(i, &o)| o == i) {
        // Distinct keys (what clients that reduce duplicates send): every
        // row stepped on its own, on every core.
        use rayon::prelude::*;
        let each = rows.par_chunks_mut(w).zip(grads.par_chunks(d)).zip(found.par_iter());
        match updated {
            Some(u) => each.zip(u.par_chunks_mut(d)).with_min_len(1024).for_each(|(((row, g), &f), u)| {
                if f {
                    step.apply(row, g);
                    u.copy_from_slice(&row[..d]);
                } else {
                    u.fill(0.0);
                }
            }),
            None => each.with_min_len(1024).for_each(|((row, g), &f)| {
                if f {
                    step.apply(row, g);
                }
            }),
        }
    } else {
        step_in_order(step, &own, &mut rows, grads, found, updated, w);
    }
    let write: Vec<usize> = (0..n).filter(|&i| found[i] && own[i] == i).collect();
    if !write.is_empty() {
        let k: Vec<u64> = write.iter().map(|&i| keys[i]).collect();
        let v: Vec<f32> = write.iter().flat_map(|&i| rows[i * w..(i + 1) * w].iter().copied()).collect();
        s.assign(&k, &v, None, None)?;
    }
    Ok(missing)
}

/// The default's step with duplicate keys: each occurrence steps the row
/// of its key's first occurrence, in index order.
fn step_in_order(
    step: &optim::Step,
    own: &[usize],
    rows: &mut [f32],
    grads: &[f32],
    found: &[bool],
    mut updated: Option<&mut [f32]>,
    w: usize,
) {
    let d = step.dim;
    for i in 0..own.len() {
        if !found[i] {
            if let Some(u) = updated.as_deref_mut() {
                u[i * d..(i + 1) * d].fill(0.0);
            }
            continue;
        }
        let o = own[i];
        let row = &mut rows[o * w..(o + 1) * w];
        step.apply(row, &grads[i * d..(i + 1) * d]);
        if let Some(u) = updated.as_deref_mut() {
            u[i * d..(i + 1) * d].copy_from_slice(&row[..d]);
        }
    }
}

pub(crate) fn find_at_by_find<S: Shard + ?Sized>(
    s: &S,
    keys: &[u64],
    at: &[u32],
    values: &mut [f32],
    found: &mut [u8],
) -> Result<usize> {
    check::rows_at(s.config(), keys.len(), at, values.len(), found.len())?;
    let dim = s.config().dim;
    let mut v = vec![0.0; keys.len() * dim];
    let mut f = vec![false; keys.len()];
    let hits = s.find(keys, &mut v, &mut f, None)?;
    for (i, &r) in at.iter().enumerate() {
        let r = r as usize;
        values[r * dim..(r + 1) * dim].copy_from_slice(&v[i * dim..(i + 1) * dim]);
        found[r] = u8::from(f[i]);
    }
    Ok(hits)
}

/// Opens a shard on the chosen backend (CUDA: device 0).
pub fn open(config: TableConfig, backend: Backend) -> Result<Box<dyn Shard>> {
    open_on(config, backend, 0)
}

/// Opens a shard on the chosen backend; CUDA shards on device `ordinal`.
/// `Auto` picks CUDA when a driver and that device are present, else CPU.
pub fn open_on(config: TableConfig, backend: Backend, ordinal: usize) -> Result<Box<dyn Shard>> {
    match backend {
        Backend::Cpu => Ok(Box::new(cpu::CpuTable::new(config)?)),
        Backend::Cuda => Ok(Box::new(cuda_table::CudaTable::new(config, cuda::shared_device(ordinal)?)?)),
        Backend::Auto => match cuda::probe() {
            Ok(d) if d.iter().any(|d| d.ordinal == ordinal) => {
                Ok(Box::new(cuda_table::CudaTable::new(config, cuda::shared_device(ordinal)?)?))
            }
            _ => Ok(Box::new(cpu::CpuTable::new(config)?)),
        },
    }
}

/// Why the CUDA backend cannot hold a table on this host (no driver
/// library, no device), or `None` when it can.
pub fn cuda_unavailable() -> Option<Error> {
    cuda::probe().err()
}
