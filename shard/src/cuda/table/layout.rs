//! The C structs the kernels take by value, as #[repr(C)] Rust twins, and
//! the assert that ties each to the ABI list `kernels/abi.h`: a size or a
//! field offset that differs from the list fails `cargo build` (the CUDA
//! side asserts the same list with `static_assert`s when NVRTC compiles
//! the kernels).
//!
//! This file uses nothing but `hkv_kernels::assert_abi_layout!`: the tests
//! below compile it on its own, against an altered list, to show that a
//! mismatch is refused.

/// `HkvTable` of `kernels/abi.h`, field for field.
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
    ///
    /// [`CudaTable::key_order`]: super::CudaTable::key_order
    pub(super) order: u64,
}

/// `HkvScoring` of `kernels/abi.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct ScoringArgs {
    pub(super) now_ns: u64,
    /// `hkv_kernels::abi::HKV_LRU` ... (`policy_code`).
    pub(super) policy: u32,
    pub(super) epoch: u32,
    pub(super) verbatim: u32,
    /// Lfu: 1 for `LfuTies::Lru` (packed frequency and stamp), 0 for plain frequencies.
    pub(super) lfu_lru: u32,
}

/// `HkvFilter` of `kernels/abi.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct FilterArgs {
    pub(super) key_mask: u64,
    pub(super) key_pattern: u64,
    pub(super) min_score: u64,
    pub(super) max_score: u64,
}

/// `HkvSample` of `kernels/abi.h`: the miss-ratio sampler a lookup kernel
/// runs fused (`super::sampling`); `ring` 0 (the default): off.
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

hkv_kernels::assert_abi_layout!(
    HkvTable => TableArgs,
    HkvScoring => ScoringArgs,
    HkvFilter => FilterArgs,
    HkvSample => SampleArgs,
);
