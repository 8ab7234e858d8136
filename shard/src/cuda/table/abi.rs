//! The codes the kernels take (from the ABI list, `kernels/abi.h`), the
//! counters they write and the raw device pointers of one launch; the C
//! structs they take by value are in `layout`.

use super::*;

use hkv_kernels::abi;

pub(super) const C_HITS: usize = abi::HKV_C_HITS as usize;

pub(super) const C_UPDATED: usize = abi::HKV_C_UPDATED as usize;

pub(super) const C_LOST: usize = abi::HKV_C_LOST as usize;

pub(super) const C_ERASED: usize = abi::HKV_C_ERASED as usize;

pub(super) const NCOUNTERS: usize = abi::HKV_NCOUNTERS as usize;

pub(super) const UP_INSERT: i32 = abi::HKV_UP_INSERT as i32;

pub(super) const UP_FIND_OR_INSERT: i32 = abi::HKV_UP_FIND_OR_INSERT as i32;

pub(super) const UP_ACCUM: i32 = abi::HKV_UP_ACCUM as i32;

pub(super) const UP_FIND_OR_INSERT_PTR: i32 = abi::HKV_UP_FIND_OR_INSERT_PTR as i32;

pub(super) const SCORES_POLICY: u32 = abi::HKV_SCORES_POLICY;

pub(super) const SCORES_VERBATIM: u32 = abi::HKV_SCORES_VERBATIM;

pub(super) const SCORES_DEFER: u32 = abi::HKV_SCORES_DEFER;

/// Passes of a verbatim write that leave keys they cannot place for the
/// next ([`CudaTable::in_passes`]): the keys a pass defers are a small
/// share of its batch, and each later pass runs them alone, so two or
/// three passes place them wherever the table has room for them.
pub(super) const DEFER_PASSES: usize = 4;

pub(super) const UPD_ASSIGN: i32 = abi::HKV_UPD_ASSIGN as i32;

pub(super) const UPD_SCORES: i32 = abi::HKV_UPD_SCORES as i32;

pub(super) const UPD_ACCUM: i32 = abi::HKV_UPD_ACCUM as i32;

// The Rust enums and constants whose values the kernels also use, tied to
// the ABI list (kernels/abi.h): a value that differs fails the build. (The
// codes above, and policy_code's, are the list's own consts.)
const _: () = {
    assert!(Outcome::Updated as u32 == abi::HKV_UPDATED);
    assert!(Outcome::Inserted as u32 == abi::HKV_INSERTED);
    assert!(Outcome::Evicted as u32 == abi::HKV_EVICTED);
    assert!(Outcome::Rejected as u32 == abi::HKV_REJECTED);
    assert!(Outcome::Absent as u32 == abi::HKV_ABSENT);
    // The counters of the outcomes are C_UPDATED + the outcome (counts()).
    assert!(abi::HKV_C_INSERTED == abi::HKV_C_UPDATED + abi::HKV_INSERTED);
    assert!(abi::HKV_C_EVICTED == abi::HKV_C_UPDATED + abi::HKV_EVICTED);
    assert!(abi::HKV_C_REJECTED == abi::HKV_C_UPDATED + abi::HKV_REJECTED);
    assert!(abi::HKV_C_ABSENT == abi::HKV_C_UPDATED + abi::HKV_ABSENT);
    assert!(Lost::Evicted as u32 == abi::HKV_LOST_EVICTED);
    assert!(Lost::Rejected as u32 == abi::HKV_LOST_REJECTED);
    assert!(Kind::Lookup as u32 == abi::HKV_TAG_LOOKUP);
    assert!(Kind::FindOrInsert as u32 == abi::HKV_TAG_FIND_OR_INSERT);
    assert!(Kind::Write as u32 == abi::HKV_TAG_WRITE);
    assert!(Kind::Update as u32 == abi::HKV_TAG_UPDATE);
    assert!(crate::mrc::OUTCOME_KNOWN as u32 == abi::HKV_TAG_OUTCOME_KNOWN);
    assert!(crate::mrc::OUTCOME_HIT as u32 == abi::HKV_TAG_OUTCOME_HIT);
    assert!(BUCKET_SLOTS as u64 == abi::HKV_BUCKET_SLOTS);
    assert!(crate::EMPTY_KEY == abi::HKV_EMPTY_KEY);
    assert!(crate::hash::DUAL_SEED == abi::HKV_DUAL_SEED);
    assert!(crate::hash::SHARD_SEED == abi::HKV_SHARD_SEED);
    assert!(crate::score::LFU_STAMP_BITS == abi::HKV_LFU_STAMP_BITS);
};

// SAFETY: plain #[repr(C)] structs of integers (layout.rs) whose size and
// field offsets equal those of the C structs the kernels take by value
// (HkvTable, HkvScoring, HkvFilter in kernels/abi.h): both are asserted
// against the ABI list, at build time here and by NVRTC on the C side.
unsafe impl DeviceRepr for TableArgs {}

// SAFETY: as above.
unsafe impl DeviceRepr for ScoringArgs {}

// SAFETY: as above.
unsafe impl DeviceRepr for FilterArgs {}

// SAFETY: as above (HkvSample).
unsafe impl DeviceRepr for SampleArgs {}

// SAFETY: as above (HkvStep; u32 and f32 fields).
unsafe impl DeviceRepr for StepArgs {}

/// The kernels' arguments of an optimizer step (`step_keys`): Adam's bias
/// terms computed as the CPU backend computes them ([`crate::optim::Step::adam_terms`]).
pub(super) fn step_args(step: &crate::optim::Step) -> StepArgs {
    use crate::optim::Optimizer;
    let h = &step.hyper;
    let (step_size, bias2_sqrt) = step.adam_terms();
    StepArgs {
        optimizer: match step.optimizer {
            Optimizer::Sgd => abi::HKV_OPT_SGD,
            Optimizer::Adagrad => abi::HKV_OPT_ADAGRAD,
            Optimizer::RowwiseAdagrad => abi::HKV_OPT_ROWWISE_ADAGRAD,
            Optimizer::Adam => abi::HKV_OPT_ADAM,
        },
        dim: step.dim as u32,
        lr: h.lr,
        eps: h.eps,
        beta1: h.beta1,
        beta2: h.beta2,
        weight_decay: h.weight_decay,
        step_size,
        bias2_sqrt,
        pad: 0,
    }
}

/// What a kind byte of insert_and_evict's output says.
pub(super) fn lost_kind(k: u8) -> Lost {
    if u32::from(k) == abi::HKV_LOST_EVICTED {
        Lost::Evicted
    } else {
        Lost::Rejected
    }
}

/// The kernels' code of a policy (`HkvScoring::policy`).
pub(super) fn policy_code(p: ScorePolicy) -> u32 {
    match p {
        ScorePolicy::Lru => abi::HKV_LRU,
        ScorePolicy::Lfu => abi::HKV_LFU,
        ScorePolicy::EpochLru => abi::HKV_EPOCH_LRU,
        ScorePolicy::EpochLfu => abi::HKV_EPOCH_LFU,
        ScorePolicy::Custom => abi::HKV_CUSTOM,
        ScorePolicy::Adaptive => abi::HKV_ADAPTIVE,
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
    /// apply_gradients: each key's values after its step (zeros if absent).
    pub(crate) updated: Option<DevPtr<f32>>,
    pub(crate) counters: Option<DevPtr<u64>>,
    /// Lookups: the sampler the kernel runs fused ([`CudaTable::sample_args`]; default: off).
    pub(crate) sample: SampleArgs,
    /// find: write a miss as a row of zeros (the `lookup_findz` kernels)
    /// instead of leaving its row as it was.
    pub(crate) zero_misses: bool,
    /// Lookups: a find, whose hits refresh their scores when the table's
    /// reads refresh ([`CudaTable::read_scoring`]).
    pub(crate) find: bool,
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
