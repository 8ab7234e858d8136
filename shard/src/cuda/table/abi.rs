//! The C structs the kernels take by value, their codes, the counters
//! they write and the raw device pointers of one launch.

use super::*;

pub(super) const C_HITS: usize = 0;

pub(super) const C_UPDATED: usize = 1;

pub(super) const C_LOST: usize = 6;

pub(super) const C_ERASED: usize = 7;

pub(super) const NCOUNTERS: usize = 8;

pub(super) const UP_INSERT: i32 = 0;

pub(super) const UP_FIND_OR_INSERT: i32 = 1;

pub(super) const UP_ACCUM: i32 = 2;

pub(super) const UP_FIND_OR_INSERT_PTR: i32 = 3;

pub(super) const UPD_ASSIGN: i32 = 0;

pub(super) const UPD_SCORES: i32 = 1;

pub(super) const UPD_ACCUM: i32 = 2;

/// `HkvTable` of `table.cuh`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct TableArgs {
    pub(super) digests: u64,
    pub(super) keys: u64,
    pub(super) scores: u64,
    pub(super) sizes: u64,
    pub(super) locks: u64,
    pub(super) fast: u64,
    pub(super) slices: u64,
    pub(super) fast_slots: u64,
    pub(super) nbuckets: u64,
    pub(super) slice_shift: u32,
    pub(super) dim: u32,
    pub(super) dual: u32,
    pub(super) pad: u32,
    /// Per launch: the key order of [`CudaTable::key_order`] (0: index order).
    pub(super) order: u64,
}

/// `HkvScoring` of `table.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct ScoringArgs {
    pub(super) now_ns: u64,
    pub(super) policy: u32,
    pub(super) epoch: u32,
    pub(super) verbatim: u32,
    /// Lfu: 1 for [`LfuTies::Lru`] (packed frequency and stamp), 0 for plain frequencies.
    pub(super) lfu_lru: u32,
}

/// `HkvFilter` of `table.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct FilterArgs {
    pub(super) key_mask: u64,
    pub(super) key_pattern: u64,
    pub(super) min_score: u64,
    pub(super) max_score: u64,
}

/// `HkvSample` of `table.cuh`: the miss-ratio sampler a lookup kernel runs
/// fused ([`super::sampling`]); `ring` 0 (the default): off.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SampleArgs {
    /// The ring's `cap` key slots and its 2 counters (slots claimed, accesses).
    pub(super) ring: u64,
    pub(super) counters: u64,
    pub(super) cap: u64,
    pub(super) seed: u64,
    pub(super) threshold: u64,
    /// The ring's `cap` tag bytes, one beside each key slot (issue 32).
    pub(super) tags: u64,
    /// This batch's tag (`mrc::tag`: the op's `mrc::Kind`, the batch's
    /// sequence number); only kinds 0 and 1 (lookups) count accesses.
    pub(super) tag: u64,
}

const _: () = {
    assert!(std::mem::size_of::<SampleArgs>() == 56);
    assert!(std::mem::offset_of!(SampleArgs, tags) == 40);
    assert!(std::mem::offset_of!(SampleArgs, tag) == 48);
};

// SAFETY: plain #[repr(C)] structs of integers whose layout matches the C
// structs the kernels take by value (HkvTable, HkvScoring, HkvFilter in
// kernels/table.cuh): same field order, types and padding.
unsafe impl DeviceRepr for TableArgs {}

// SAFETY: as above.
unsafe impl DeviceRepr for ScoringArgs {}

// SAFETY: as above.
unsafe impl DeviceRepr for FilterArgs {}

// SAFETY: as above (HkvSample).
unsafe impl DeviceRepr for SampleArgs {}

pub(super) fn policy_code(p: ScorePolicy) -> u32 {
    match p {
        ScorePolicy::Lru => 0,
        ScorePolicy::Lfu => 1,
        ScorePolicy::EpochLru => 2,
        ScorePolicy::EpochLfu => 3,
        ScorePolicy::Custom => 4,
        ScorePolicy::Adaptive => 5,
    }
}

pub(super) fn filter_args(f: &Filter) -> FilterArgs {
    FilterArgs { key_mask: f.key_mask, key_pattern: f.key_pattern, min_score: f.min_score, max_score: f.max_score }
}

/// The device address of a buffer, for a kernel argument (event tracking
/// is off for the table's context: every lane synchronises its own stream).
pub(crate) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

/// The device address of a buffer, or 0 when there is none.
pub(crate) fn opt_ptr<T>(s: &Option<CudaSlice<T>>, stream: &CudaStream) -> u64 {
    s.as_ref().map_or(0, |s| ptr(s, stream))
}

/// Device buffers of one kernel call (`None`: the kernel gets null).
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct Ptrs {
    pub(crate) keys: Option<DevPtr<u64>>,
    pub(crate) values: Option<DevPtr<f32>>,
    pub(crate) scores: Option<DevPtr<u64>>,
    pub(crate) found: Option<DevPtr<u8>>,
    pub(crate) outcomes: Option<DevPtr<u8>>,
    pub(crate) ptrs: Option<DevPtr<u64>>,
    pub(crate) only: Option<DevPtr<u8>>,
    /// Lookups: each key's output row (`None`: key i to row i).
    pub(crate) at: Option<DevPtr<u32>>,
    /// insert_and_evict: what lost its slot.
    pub(crate) lost: Option<LostPtrs>,
    pub(crate) counters: Option<DevPtr<u64>>,
    /// Lookups: the sampler the kernel runs fused ([`CudaTable::sample_args`]; default: off).
    pub(crate) sample: SampleArgs,
    /// find: write a miss as a row of zeros (the `lookup_findz` kernels)
    /// instead of leaving its row as it was.
    pub(crate) zero_misses: bool,
}

/// An export's outputs: keys, rows and scores of the matches.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExportPtrs {
    pub(crate) keys: DevPtr<u64>,
    pub(crate) values: DevPtr<f32>,
    pub(crate) scores: DevPtr<u64>,
}

/// insert_and_evict's outputs: keys, rows, scores and kinds of what lost
/// its slot (at most one per key).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LostPtrs {
    pub(crate) keys: DevPtr<u64>,
    pub(crate) values: DevPtr<f32>,
    pub(crate) scores: DevPtr<u64>,
    pub(crate) kinds: DevPtr<u8>,
}

/// Per-batch results read back from the counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    /// Hits (lookups).
    pub hits: u64,
    /// Outcome counts.
    pub summary: Summary,
    /// Entries in the insert_and_evict output.
    pub lost: u64,
    /// Entries erased.
    pub erased: u64,
}

impl Counts {
    /// Sums the counts of two batches (or of two GPUs' parts of one).
    pub fn merge(self, o: Counts) -> Counts {
        Counts {
            hits: self.hits + o.hits,
            summary: self.summary.merge(o.summary),
            lost: self.lost + o.lost,
            erased: self.erased + o.erased,
        }
    }
}

pub(super) fn counts(c: &[u64]) -> Counts {
    Counts {
        hits: c[C_HITS],
        summary: Summary {
            updated: c[C_UPDATED],
            inserted: c[C_UPDATED + 1],
            evicted: c[C_UPDATED + 2],
            rejected: c[C_UPDATED + 3],
            absent: c[C_UPDATED + 4],
        },
        lost: c[C_LOST],
        erased: c[C_ERASED],
    }
}
